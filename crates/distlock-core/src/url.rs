//! The URL grammar every backend shares, parsed by hand because host lists are comma-separated
//! (`redis+sentinel://h:p,h:p/mymaster`), which `url::Url` does not accept.
//!
//! For backend crates (`from_url`) and the facade's `connect`; users pass URLs as strings.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use crate::duration;
use crate::error::{Error, ErrorKind, Result};

/// A lock-service URL: `scheme://[user[:password]@]host[:port][,host[:port]…][/path][?k=v&…]`.
///
/// ```
/// use distlock_core::url::LockUrl;
/// let url = LockUrl::parse("redis+sentinel://u:secret@a:26379,b:26380/mymaster?lease=10s").unwrap();
/// assert_eq!(url.scheme(), "redis+sentinel");
/// assert_eq!(url.hosts(), ["a:26379", "b:26380"]);
/// assert_eq!(url.path(), "/mymaster");
/// assert_eq!(url.username(), Some("u"));
/// assert_eq!(url.password(), Some("secret"));
/// assert_eq!(url.query("lease"), Some("10s"));
/// assert!(!format!("{url:?}").contains("secret"));
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct LockUrl {
    scheme: String,
    username: Option<String>,
    password: Option<String>,
    hosts: Vec<String>,
    path: String,
    query: Vec<(String, String)>,
}

fn invalid(url: &str, why: impl fmt::Display) -> Error {
    Error::new(
        ErrorKind::InvalidConfig,
        format!("invalid URL {:?}: {why}", redact(url)),
    )
}

/// The URL with any password replaced by `***`, for messages.
pub fn redact(url: &str) -> String {
    let Some(scheme_end) = url.find("://") else {
        return url.to_string();
    };
    let rest = &url[scheme_end + 3..];
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) => {
            let userinfo = &rest[..at];
            let user = userinfo.split(':').next().unwrap_or("");
            let shown = if userinfo.contains(':') {
                format!("{user}:***")
            } else {
                user.to_string()
            };
            format!("{}://{}{}", &url[..scheme_end], shown, &rest[at..])
        }
        None => url.to_string(),
    }
}

impl LockUrl {
    /// Parses a URL; the scheme is lower-cased, nothing else is interpreted.
    pub fn parse(text: &str) -> Result<Self> {
        let text = text.trim();
        let Some(scheme_end) = text.find("://") else {
            return Err(invalid(
                text,
                "expected scheme://…, for example file:///var/lock/myapp or redis://127.0.0.1:6379",
            ));
        };
        let scheme = text[..scheme_end].to_ascii_lowercase();
        if scheme.is_empty()
            || !scheme
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
        {
            return Err(invalid(
                text,
                "the scheme is empty or has characters a scheme cannot have",
            ));
        }
        let rest = &text[scheme_end + 3..];
        let (before_query, query_text) = match rest.split_once('?') {
            Some((a, q)) => (a, Some(q)),
            None => (rest, None),
        };
        let authority_end = before_query.find('/').unwrap_or(before_query.len());
        let (authority, path) = before_query.split_at(authority_end);
        let (userinfo, host_list) = match authority.rfind('@') {
            Some(at) => (Some(&authority[..at]), &authority[at + 1..]),
            None => (None, authority),
        };
        let (username, password) = match userinfo {
            Some(info) => match info.split_once(':') {
                Some((u, p)) => (non_empty(u), Some(percent_decode(p))),
                None => (non_empty(info), None),
            },
            None => (None, None),
        };
        let hosts: Vec<String> = if host_list.is_empty() {
            Vec::new()
        } else {
            host_list.split(',').map(|h| h.trim().to_string()).collect()
        };
        if hosts.iter().any(|h| h.is_empty()) {
            return Err(invalid(text, "the host list has an empty entry"));
        }
        for host in &hosts {
            if let Some((_, port)) = host.rsplit_once(':') {
                if !host.ends_with(']') && parse_port(port).is_none() {
                    return Err(invalid(
                        text,
                        format_args!("port {port:?} is not a number from 1 to 65535"),
                    ));
                }
            }
        }
        let mut query = Vec::new();
        if let Some(q) = query_text {
            for pair in q.split('&').filter(|p| !p.is_empty()) {
                let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
                query.push((percent_decode(k), percent_decode(v)));
            }
        }
        Ok(Self {
            scheme,
            username,
            password,
            hosts,
            path: percent_decode(path),
            query,
        })
    }

    /// The scheme, lower-cased.
    pub fn scheme(&self) -> &str {
        &self.scheme
    }

    /// The user name, if any.
    pub fn username(&self) -> Option<&str> {
        self.username.as_deref()
    }

    /// The password, if any. Never printed by `Debug`.
    pub fn password(&self) -> Option<&str> {
        self.password.as_deref()
    }

    /// The hosts in the order given, each `host[:port]`.
    pub fn hosts(&self) -> &[String] {
        &self.hosts
    }

    /// The path, starting with `/` when present, percent-decoded.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// All query parameters in order.
    pub fn query_pairs(&self) -> &[(String, String)] {
        &self.query
    }

    /// The last value of a query parameter.
    pub fn query(&self, key: &str) -> Option<&str> {
        self.query
            .iter()
            .rev()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// A query parameter read as a duration (`500ms`, `10s`), naming the parameter on error.
    pub fn query_duration(&self, key: &str) -> Result<Option<Duration>> {
        self.query(key)
            .map(|v| {
                duration::parse(v).map_err(|e| {
                    Error::new(
                        ErrorKind::InvalidConfig,
                        format!("URL parameter {key}: {}", e.message()),
                    )
                })
            })
            .transpose()
    }

    /// The host list as endpoints, `default_port` where a host names none. Fails with
    /// [`ErrorKind::InvalidConfig`] on an empty list.
    ///
    /// ```
    /// use distlock_core::url::{Endpoint, LockUrl};
    /// let url = LockUrl::parse("etcd://a,b:2380,[::1],[::1]:7")?;
    /// let shown: Vec<String> = url.endpoints(2379)?.iter().map(Endpoint::to_string).collect();
    /// assert_eq!(shown, ["a:2379", "b:2380", "[::1]:2379", "[::1]:7"]);
    /// assert!(LockUrl::parse("etcd://")?.endpoints(2379).is_err());
    /// # Ok::<(), distlock_core::Error>(())
    /// ```
    pub fn endpoints(&self, default_port: u16) -> Result<Vec<Endpoint>> {
        if self.hosts.is_empty() {
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                format!(
                    "a {scheme}:// URL needs a host, for example {scheme}://127.0.0.1:{default_port}",
                    scheme = self.scheme
                ),
            ));
        }
        self.hosts
            .iter()
            .map(|h| Endpoint::parse(h, default_port))
            .collect()
    }

    /// `?ca=/path/ca.pem`: a PEM file with the CA(s) that signed the servers' certificates. Needs a TLS
    /// scheme (`tls`); an empty path is refused.
    pub fn ca_file(&self, tls: bool) -> Result<Option<PathBuf>> {
        let Some(ca) = self.query("ca") else {
            return Ok(None);
        };
        if !tls {
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                format!(
                    "URL parameter ca needs TLS: {}:// is plain text (use the scheme ending in s)",
                    self.scheme
                ),
            ));
        }
        if ca.is_empty() {
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                "URL parameter ca: the path of a PEM file is missing, e.g. ?ca=/path/ca.pem",
            ));
        }
        Ok(Some(PathBuf::from(ca)))
    }

    /// A query parameter read as a duration that must not be zero (`connect_timeout`,
    /// `request_timeout`).
    pub fn query_timeout(&self, key: &str) -> Result<Option<Duration>> {
        match self.query_duration(key)? {
            Some(d) if d.is_zero() => Err(Error::new(
                ErrorKind::InvalidConfig,
                format!("URL parameter {key} must not be 0"),
            )),
            other => Ok(other),
        }
    }

    /// Fails with a clear message if the URL carries a query parameter outside `known`, so that a typo
    /// is not silently ignored.
    pub fn reject_unknown_query(&self, known: &[&str]) -> Result<()> {
        for (k, _) in &self.query {
            if !known.contains(&k.as_str()) {
                return Err(Error::new(
                    ErrorKind::InvalidConfig,
                    format!(
                        "unknown URL parameter {k:?} for {}://; known: {}",
                        self.scheme,
                        if known.is_empty() {
                            "none".to_string()
                        } else {
                            known.join(", ")
                        }
                    ),
                ));
            }
        }
        Ok(())
    }
}

impl fmt::Debug for LockUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockUrl")
            .field("scheme", &self.scheme)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("hosts", &self.hosts)
            .field("path", &self.path)
            .field("query", &self.query)
            .finish()
    }
}

/// A server address: a host name or IP address, and a port.
///
/// ```
/// use distlock_core::url::Endpoint;
/// let e = Endpoint::parse("[::1]", 6379)?;
/// assert_eq!((e.host(), e.port(), e.to_string()), ("::1", 6379, "[::1]:6379".to_string()));
/// for bad in ["", "h:", ":1", "h:x", "[::1", "[::1]x", "h:99999"] {
///     assert!(Endpoint::parse(bad, 1).is_err(), "{bad}");
/// }
/// # Ok::<(), distlock_core::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Endpoint {
    host: String,
    port: u16,
}

impl Endpoint {
    /// A host and port.
    pub fn new(host: impl Into<String>, port: u16) -> Self {
        Self {
            host: host.into(),
            port,
        }
    }

    /// Parses `host`, `host:port`, `[v6]` or `[v6]:port`; `default_port` where none is given.
    pub fn parse(text: &str, default_port: u16) -> Result<Self> {
        let bad = || {
            Error::new(
                ErrorKind::InvalidConfig,
                format!("{text:?} is not host[:port] (an IPv6 address goes in brackets: [::1]:{default_port})"),
            )
        };
        let (host, port) = if let Some(rest) = text.strip_prefix('[') {
            let (host, after) = rest.split_once(']').ok_or_else(bad)?;
            // Brackets hold an IPv6 address (with a `%zone` if link-local), nothing else.
            let address = host.split_once('%').map_or(host, |(address, _)| address);
            if address.parse::<std::net::Ipv6Addr>().is_err() || !plain_host(host) {
                return Err(bad());
            }
            match after.strip_prefix(':') {
                Some(p) => (host, parse_port(p).ok_or_else(bad)?),
                None if after.is_empty() => (host, default_port),
                None => return Err(bad()),
            }
        } else {
            let (host, port) = match text.rsplit_once(':') {
                Some((host, p)) => (host, parse_port(p).ok_or_else(bad)?),
                None => (text, default_port),
            };
            if host.contains(':') || !plain_host(host) {
                return Err(bad());
            }
            (host, port)
        };
        Ok(Self::new(host, port))
    }

    /// The host, without brackets.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

/// A port as written in `host:port`: digits only (no sign), 1 to 65535 (port 0 names no server).
fn parse_port(text: &str) -> Option<u16> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse::<u16>().ok().filter(|&p| p != 0)
}

/// A host that cannot be mistaken for more than a host: not empty, and none of whitespace, control
/// characters or the URL delimiters (`@` of a user, `/` of a path, `,` of a host list, `?`, `#`,
/// brackets), which mean the text was not one `host[:port]`.
fn plain_host(host: &str) -> bool {
    !host.is_empty()
        && !host.chars().any(|c| {
            c.is_whitespace()
                || c.is_control()
                || matches!(c, '@' | '/' | ',' | '?' | '#' | '[' | ']')
        })
}

fn non_empty(s: &str) -> Option<String> {
    (!s.is_empty()).then(|| percent_decode(s))
}

/// Decodes `%XX` escapes; malformed escapes are kept as written.
pub fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            if let (Some(hi), Some(lo)) = (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                out.push(hi * 16 + lo);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn hex(b: u8) -> Option<u8> {
    (b as char).to_digit(16).map(|d| d as u8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_forms_that_name_a_server() {
        for (text, host, port) in [
            ("h", "h", 1),
            ("h:65535", "h", 65535),
            ("10.0.0.1:80", "10.0.0.1", 80),
            ("[::1]", "::1", 1),
            ("[::1]:7", "::1", 7),
            ("[fe80::1%eth0]:7", "fe80::1%eth0", 7),
            ("[2001:db8::ffff:1.2.3.4]:7", "2001:db8::ffff:1.2.3.4", 7),
        ] {
            let e = Endpoint::parse(text, 1).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!((e.host(), e.port()), (host, port), "{text}");
            assert_eq!(Endpoint::parse(&e.to_string(), 1).ok(), Some(e), "{text}");
        }
    }

    #[test]
    fn endpoint_forms_that_cannot_name_a_server_are_refused() {
        for bad in [
            "h:0",
            "h:65536",
            "h:+80",
            " h:80",
            "h :80",
            "h\t:80",
            "user@h:80",
            "h/x:80",
            "a,b:80",
            "h?x:80",
            "h#x",
            "h]:80",
            "[h]:80",
            "[1.2.3.4]:80",
            "[::1]:0",
            "[:: 1]:80",
        ] {
            assert!(Endpoint::parse(bad, 1).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn lock_url_agrees_with_endpoint_on_ports() {
        for bad in ["redis://h:0", "redis://h:+80", "redis://[::1]:0"] {
            assert!(
                LockUrl::parse(bad).is_err()
                    || LockUrl::parse(bad).and_then(|u| u.endpoints(1)).is_err(),
                "{bad} was accepted"
            );
        }
        let url = LockUrl::parse("redis://h:65535,[::1]:1").unwrap();
        assert_eq!(url.endpoints(1).unwrap().len(), 2);
    }
}

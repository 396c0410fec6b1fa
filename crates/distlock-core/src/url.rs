//! The URL grammar every backend shares, parsed by hand because host lists are comma-separated
//! (`redis+sentinel://h:p,h:p/mymaster`), which `url::Url` does not accept.

use std::fmt;
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
/// assert_eq!(url.password(), Some("secret"));
/// assert_eq!(url.query("lease"), Some("10s"));
/// assert!(!format!("{url:?}").contains("secret"));
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct LockUrl {
    scheme: String,
    user: Option<String>,
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
        let (user, password) = match userinfo {
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
                if !host.ends_with(']') && port.parse::<u16>().is_err() {
                    return Err(invalid(
                        text,
                        format_args!("port {port:?} is not a number from 0 to 65535"),
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
            user,
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
    pub fn user(&self) -> Option<&str> {
        self.user.as_deref()
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
            .field("user", &self.user)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("hosts", &self.hosts)
            .field("path", &self.path)
            .field("query", &self.query)
            .finish()
    }
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

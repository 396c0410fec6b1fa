//! TLS to PostgreSQL through rustls (ring provider, as the workspace's other TLS clients), with
//! libpq's `sslmode` and `sslrootcert` read from the URL.
//!
//! tokio-postgres itself knows only `sslmode=disable|prefer|require` and no `sslrootcert`, so distlock
//! takes libpq's spellings out of the URL before the driver parses it and hands the driver
//! `sslmode=require` for the verifying modes. What each mode checks (as libpq does):
//!
//! | `sslmode`     | TLS                      | certificate chain | host name |
//! |---------------|--------------------------|-------------------|-----------|
//! | `disable`     | never                    | –                 | –         |
//! | `prefer`      | if the server offers it  | no¹               | no        |
//! | `require`     | always                   | no¹               | no        |
//! | `verify-ca`   | always                   | yes               | no        |
//! | `verify-full` | always                   | yes               | yes       |
//!
//! ¹ libpq verifies the chain in `prefer` / `require` too once a root certificate is given; so does
//! distlock when the URL names `sslrootcert=`.
//!
//! `sslrootcert=<file>` (PEM) is trusted instead of the system roots; without it (or with
//! `sslrootcert=system`, libpq 16's spelling) the verifying modes use the system roots. The same
//! connector serves the cancel request (`cancel_query`), so a cancel is encrypted and verified like
//! the connection it cancels.

use std::future::Future;
use std::io;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use distlock_core::url::percent_decode;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect};

use crate::error::SqlError;

/// How much of the server's certificate is checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verify {
    /// Encrypt only (`prefer`, `require` without `sslrootcert`): any certificate is accepted, but the
    /// handshake's signatures are still checked against the key it presents.
    Nothing,
    /// The chain up to a trusted root (`verify-ca`, or `require` / `prefer` with `sslrootcert`).
    Chain,
    /// The chain and the host name (`verify-full`).
    ChainAndHost,
}

/// Where the trusted roots come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Roots {
    /// The system's (`rustls-native-certs`).
    System,
    /// A PEM file (`sslrootcert=`).
    File(PathBuf),
}

/// What the URL asked of TLS, and the URL with libpq's TLS spellings replaced by tokio-postgres' own.
#[derive(Debug)]
pub(crate) struct TlsRequest {
    pub(crate) url: String,
    pub(crate) verify: Verify,
    pub(crate) roots: Roots,
}

/// Reads `sslmode` and `sslrootcert` from the (already distlock-stripped) URL's query.
pub(crate) fn read_url(url: &str) -> Result<TlsRequest, SqlError> {
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    let mut kept = Vec::new();
    let mut mode = None;
    let mut rootcert = None;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        match key {
            "sslmode" => mode = Some(percent_decode(value)),
            "sslrootcert" => rootcert = Some(percent_decode(value)),
            _ => kept.push(pair.to_string()),
        }
    }
    let roots = match rootcert.as_deref() {
        None | Some("system") => Roots::System,
        Some("") => {
            return Err(SqlError::Config(
                "URL parameter sslrootcert is empty: name the CA certificate file (PEM)".into(),
            ))
        }
        Some(path) => Roots::File(PathBuf::from(path)),
    };
    let pinned = matches!(roots, Roots::File(_));
    // tokio-postgres' own default is prefer, as libpq's.
    let (driver_mode, verify) = match mode.as_deref().unwrap_or("prefer") {
        "disable" => {
            if rootcert.is_some() {
                return Err(SqlError::Config(
                    "URL parameter sslrootcert needs TLS, but sslmode=disable turns it off".into(),
                ));
            }
            ("disable", Verify::Nothing)
        }
        // libpq: a root certificate makes prefer and require verify the chain.
        "prefer" if pinned => ("prefer", Verify::Chain),
        "prefer" => ("prefer", Verify::Nothing),
        "require" if pinned => ("require", Verify::Chain),
        "require" => ("require", Verify::Nothing),
        "verify-ca" => ("require", Verify::Chain),
        "verify-full" => ("require", Verify::ChainAndHost),
        "allow" => {
            return Err(SqlError::Unsupported(
                "sslmode=allow (plain first, TLS if the server insists) is not supported by \
                 tokio-postgres; use prefer, require, verify-ca or verify-full"
                    .into(),
            ))
        }
        other => {
            return Err(SqlError::Config(format!(
                "URL parameter sslmode={other:?} is not one of disable, prefer, require, verify-ca, verify-full"
            )))
        }
    };
    // Only a given sslmode is handed on: the driver's default is prefer anyway.
    if mode.is_some() {
        kept.push(format!("sslmode={driver_mode}"));
    }
    let url = if kept.is_empty() {
        base.to_string()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    Ok(TlsRequest { url, verify, roots })
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn load_roots(roots: &Roots) -> Result<RootCertStore, SqlError> {
    let mut store = RootCertStore::empty();
    match roots {
        Roots::File(path) => {
            let shown = path.display();
            let pem = std::fs::read(path).map_err(|e| {
                SqlError::Config(format!(
                    "cannot read the TLS CA file {shown} (sslrootcert=): {e}"
                ))
            })?;
            for cert in CertificateDer::pem_slice_iter(&pem) {
                let cert = cert.map_err(|e| {
                    SqlError::Config(format!(
                        "the TLS CA file {shown} (sslrootcert=) is not PEM: {e}"
                    ))
                })?;
                store.add(cert).map_err(|e| {
                    SqlError::Config(format!(
                        "the TLS CA file {shown} (sslrootcert=) holds a certificate rustls refuses: {e}"
                    ))
                })?;
            }
            if store.is_empty() {
                return Err(SqlError::Config(format!(
                    "the TLS CA file {shown} (sslrootcert=) holds no PEM certificate"
                )));
            }
        }
        Roots::System => {
            let found = rustls_native_certs::load_native_certs();
            let (added, _ignored) = store.add_parsable_certificates(found.certs);
            if added == 0 {
                return Err(SqlError::Config(format!(
                    "sslmode verifies the server's certificate, but no system root certificate was found ({} errors); \
                     name the CA with sslrootcert=<file>",
                    found.errors.len()
                )));
            }
        }
    }
    Ok(store)
}

/// The rustls client config of a request. Roots are read here, once per backend.
pub(crate) fn client_config(request: &TlsRequest) -> Result<Arc<ClientConfig>, SqlError> {
    let provider = provider();
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| {
            SqlError::Config(format!(
                "the TLS provider refused its protocol versions: {e}"
            ))
        })?;
    let config = match request.verify {
        Verify::Nothing => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(EncryptOnly { provider }))
            .with_no_client_auth(),
        Verify::Chain | Verify::ChainAndHost => {
            let store = Arc::new(load_roots(&request.roots)?);
            let webpki = WebPkiServerVerifier::builder_with_provider(store, provider)
                .build()
                .map_err(|e| SqlError::Config(format!("building the TLS verifier: {e}")))?;
            if request.verify == Verify::Chain {
                builder
                    .dangerous()
                    .with_custom_certificate_verifier(Arc::new(ChainOnly { webpki }))
                    .with_no_client_auth()
            } else {
                builder.with_webpki_verifier(webpki).with_no_client_auth()
            }
        }
    };
    Ok(Arc::new(config))
}

/// `require`: the certificate is not checked (libpq does not either), the handshake signatures are.
#[derive(Debug)]
struct EncryptOnly {
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for EncryptOnly {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// `verify-ca`: webpki's chain check, with a name mismatch forgiven (libpq checks no name here).
#[derive(Debug)]
struct ChainOnly {
    webpki: Arc<WebPkiServerVerifier>,
}

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self.webpki.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        ) {
            // webpki checks the name only after the chain, so this error means the chain is good.
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.webpki.supported_verify_schemes()
    }
}

/// tokio-postgres' TLS hook over rustls: one per backend, cloned per connection and cancel request.
#[derive(Clone)]
pub(crate) struct MakeRustls {
    config: Arc<ClientConfig>,
}

impl std::fmt::Debug for MakeRustls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MakeRustls").finish_non_exhaustive()
    }
}

impl MakeRustls {
    pub(crate) fn new(config: Arc<ClientConfig>) -> Self {
        Self { config }
    }
}

impl<S> MakeTlsConnect<S> for MakeRustls
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = RustlsStream<S>;
    type TlsConnect = RustlsConnect;
    type Error = io::Error;

    fn make_tls_connect(&mut self, domain: &str) -> Result<RustlsConnect, Self::Error> {
        // An IP address is verified as one (the certificate's IP SAN). The driver asks for a connector
        // for every host, a Unix socket's directory too (where the server never offers TLS), so a name
        // that is no server name fails only if a handshake is really attempted.
        Ok(RustlsConnect {
            config: self.config.clone(),
            name: ServerName::try_from(domain.to_string()).map_err(|e| e.to_string()),
            domain: domain.to_string(),
        })
    }
}

/// One handshake's connector.
pub(crate) struct RustlsConnect {
    config: Arc<ClientConfig>,
    name: Result<ServerName<'static>, String>,
    domain: String,
}

impl<S> TlsConnect<S> for RustlsConnect
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = RustlsStream<S>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<RustlsStream<S>>> + Send>>;

    fn connect(self, stream: S) -> Self::Future {
        let connector = tokio_rustls::TlsConnector::from(self.config);
        Box::pin(async move {
            let name = self.name.map_err(|e| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "TLS to {:?}: not a host name or IP address ({e})",
                        self.domain
                    ),
                )
            })?;
            let tls = connector.connect(name, stream).await?;
            Ok(RustlsStream(Box::new(tls)))
        })
    }
}

/// A TLS session to the server.
pub(crate) struct RustlsStream<S>(Box<tokio_rustls::client::TlsStream<S>>);

impl<S: AsyncRead + AsyncWrite + Unpin> tokio_postgres::tls::TlsStream for RustlsStream<S> {
    /// No `tls-server-end-point` binding: SCRAM then authenticates without channel binding (the
    /// driver's `channel_binding=prefer` default); `channel_binding=require` is refused by the driver.
    fn channel_binding(&self) -> ChannelBinding {
        ChannelBinding::none()
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for RustlsStream<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_read(cx, buf)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for RustlsStream<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut *self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut *self.0).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }
}

/// A "TLS" hook that wraps nothing: for reading a cancel key back from an in-memory stream.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Plain;

/// [`Plain`]'s stream: the stream itself.
pub(crate) struct PlainStream<S>(S);

impl<S: AsyncRead + AsyncWrite + Unpin + Send + 'static> TlsConnect<S> for Plain {
    type Stream = PlainStream<S>;
    type Error = io::Error;
    type Future = std::future::Ready<io::Result<PlainStream<S>>>;

    fn connect(self, stream: S) -> Self::Future {
        std::future::ready(Ok(PlainStream(stream)))
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> tokio_postgres::tls::TlsStream for PlainStream<S> {
    fn channel_binding(&self) -> ChannelBinding {
        ChannelBinding::none()
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for PlainStream<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for PlainStream<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

/// Whether a driver error came from the TLS layer: a rustls error somewhere in its source chain.
pub(crate) fn is_tls_failure(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(e);
    while let Some(e) = next {
        if e.is::<rustls::Error>() {
            return true;
        }
        if let Some(io) = e.downcast_ref::<io::Error>() {
            if io
                .get_ref()
                .is_some_and(|inner| inner.is::<rustls::Error>())
            {
                return true;
            }
        }
        next = e.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libpq_spellings_become_the_drivers() {
        let r = read_url("postgres://h/db?sslmode=verify-full&sslrootcert=%2Fca.pem&x=1").unwrap();
        assert_eq!(r.url, "postgres://h/db?x=1&sslmode=require");
        assert_eq!(
            (r.verify, r.roots),
            (Verify::ChainAndHost, Roots::File("/ca.pem".into()))
        );
        let r = read_url("postgres://h/db?sslmode=verify-ca").unwrap();
        assert_eq!((r.verify, r.roots), (Verify::Chain, Roots::System));
        let r = read_url("postgres://h/db?sslmode=require").unwrap();
        assert_eq!(
            (r.url.as_str(), r.verify),
            ("postgres://h/db?sslmode=require", Verify::Nothing)
        );
        // libpq: a root certificate makes require verify the chain.
        let r = read_url("postgres://h/db?sslmode=require&sslrootcert=/ca.pem").unwrap();
        assert_eq!(r.verify, Verify::Chain);
        let r = read_url("postgres://h/db").unwrap();
        assert_eq!(
            (r.url.as_str(), r.verify),
            ("postgres://h/db", Verify::Nothing)
        );
        assert!(matches!(
            read_url("postgres://h?sslmode=bogus"),
            Err(SqlError::Config(_))
        ));
        assert!(matches!(
            read_url("postgres://h?sslmode=allow"),
            Err(SqlError::Unsupported(_))
        ));
        assert!(matches!(
            read_url("postgres://h?sslmode=disable&sslrootcert=/ca.pem"),
            Err(SqlError::Config(_))
        ));
        assert!(matches!(
            read_url("postgres://h?sslrootcert="),
            Err(SqlError::Config(_))
        ));
    }
}

//! Throw-away TLS material for tests, generated at test time (never committed): a CA and a server
//! certificate signed by it for `localhost` and `127.0.0.1` (an IP SAN, so clients connecting to
//! `127.0.0.1` verify it), written as PEM files into a temp dir that lives as long as the [`TestCa`].
//!
//! ```no_run
//! let ca = distlock_testkit::tls::TestCa::new()?;
//! // redis-server --tls-cert-file ca.server_cert() --tls-key-file ca.server_key() …
//! // client: rediss://127.0.0.1:PORT?ca=<ca.ca_cert()>
//! # Ok::<(), distlock_testkit::Error>(())
//! ```

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use tempfile::TempDir;

use crate::error::{Error, Result};
use crate::process;

/// A fresh CA and a server certificate it signed, as PEM files in a temp dir (removed on drop).
#[derive(Debug)]
pub struct TestCa {
    dir: TempDir,
    ca_cert: PathBuf,
    server_cert: PathBuf,
    server_key: PathBuf,
}

fn tls_error(what: &str, e: rcgen::Error) -> Error {
    Error::State(format!("generating test TLS material ({what}): {e}"))
}

impl TestCa {
    /// Generates a CA (`distlock test CA <uuid>`) and a server certificate for `localhost` / `127.0.0.1`,
    /// and writes `ca.pem`, `server.pem` and `server.key` into a new temp dir.
    pub fn new() -> Result<TestCa> {
        let mut ca_params = CertificateParams::new(Vec::<String>::new())
            .map_err(|e| tls_error("CA parameters", e))?;
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        // A name of its own, so a client given another TestCa reports an unknown issuer.
        ca_params.distinguished_name.push(
            DnType::CommonName,
            format!("distlock test CA {}", uuid::Uuid::new_v4().simple()),
        );
        ca_params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca_key = KeyPair::generate().map_err(|e| tls_error("CA key", e))?;
        let ca = CertifiedIssuer::self_signed(ca_params, ca_key)
            .map_err(|e| tls_error("CA certificate", e))?;

        let mut params = CertificateParams::new(vec!["localhost".into(), "127.0.0.1".into()])
            .map_err(|e| tls_error("server parameters", e))?;
        params
            .distinguished_name
            .push(DnType::CommonName, "localhost");
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = KeyPair::generate().map_err(|e| tls_error("server key", e))?;
        let cert = params
            .signed_by(&key, &ca)
            .map_err(|e| tls_error("server certificate", e))?;

        let dir = process::temp_dir("tls")?;
        let write = |name: &str, pem: String| -> Result<PathBuf> {
            let path = dir.path().join(name);
            std::fs::write(&path, pem)
                .map_err(|e| Error::io(format!("writing {}", path.display()), e))?;
            Ok(path)
        };
        let ca_cert = write("ca.pem", ca.pem())?;
        let server_cert = write("server.pem", cert.pem())?;
        let server_key = write("server.key", key.serialize_pem())?;
        Ok(TestCa {
            dir,
            ca_cert,
            server_cert,
            server_key,
        })
    }

    /// [`new`](Self::new), panicking with the error. For tests.
    pub fn new_or_panic() -> TestCa {
        match Self::new() {
            Ok(ca) => ca,
            Err(e) => panic!("generating test TLS material failed: {e}"),
        }
    }

    /// The CA certificate (`ca.pem`): what clients trust (`?ca=`), and servers' `--*-ca-*` file.
    pub fn ca_cert(&self) -> &Path {
        &self.ca_cert
    }

    /// The server certificate (`server.pem`), for `localhost` and IP `127.0.0.1`.
    pub fn server_cert(&self) -> &Path {
        &self.server_cert
    }

    /// The server's private key (`server.key`, PKCS#8 PEM).
    pub fn server_key(&self) -> &Path {
        &self.server_key
    }

    /// The temp dir holding the files.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_pem_files() {
        let ca = TestCa::new().unwrap();
        let read = |p: &Path| std::fs::read_to_string(p).unwrap();
        assert!(read(ca.ca_cert()).starts_with("-----BEGIN CERTIFICATE-----"));
        assert!(read(ca.server_cert()).starts_with("-----BEGIN CERTIFICATE-----"));
        assert!(read(ca.server_key()).contains("PRIVATE KEY-----"));
        let other = TestCa::new().unwrap();
        assert_ne!(read(ca.ca_cert()), read(other.ca_cert()));
    }
}

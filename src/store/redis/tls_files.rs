//! Redis TLS files that rotate (`--redis-ca-file`, `--redis-client-cert`
//! and `--redis-client-key`): read again at every handshake, that is for
//! every new connection, and taken when their content changed, so that a
//! certificate renewed on disk (a Kubernetes Secret's swap, cert-manager,
//! a managed Redis's new CA) is used without a restart. A file that cannot
//! be read or parsed leaves the last good one in use, said in a warning
//! naming the file (never its content).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::Mutex;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::{ResolvesClientCert, WebPkiServerVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::sign::CertifiedKey;
use rustls::{DigitallySignedStruct, SignatureScheme};

/// How servers are checked: against the CA file as it is now (its roots
/// built again when its content changes), or against fixed roots (the
/// system's). With `any_name`, a chain that only fails on the server's
/// name is taken (`--redis-tls-skip-hostname-verification`).
#[derive(Debug)]
pub(super) struct ServerCheck {
    roots: Roots,
    provider: Arc<CryptoProvider>,
    any_name: bool,
}

#[derive(Debug)]
enum Roots {
    /// The file, the content the verifier was built from, and the verifier.
    File {
        path: PathBuf,
        current: Mutex<(Vec<u8>, Arc<WebPkiServerVerifier>)>,
    },
    Fixed(Arc<WebPkiServerVerifier>),
}

impl ServerCheck {
    /// Against the CA file at `path`, read now: a file that cannot be used
    /// stops the start.
    pub(super) fn from_file(
        path: &Path,
        provider: Arc<CryptoProvider>,
        any_name: bool,
    ) -> anyhow::Result<Self> {
        let content = std::fs::read(path)?;
        let verifier = verifier_of(crate::tls::roots(path)?, &provider)?;
        Ok(Self {
            roots: Roots::File {
                path: path.to_path_buf(),
                current: Mutex::new((content, verifier)),
            },
            provider,
            any_name,
        })
    }

    /// Against `roots`, which do not change.
    pub(super) fn fixed(
        roots: rustls::RootCertStore,
        provider: Arc<CryptoProvider>,
        any_name: bool,
    ) -> anyhow::Result<Self> {
        Ok(Self {
            roots: Roots::Fixed(verifier_of(roots, &provider)?),
            provider,
            any_name,
        })
    }

    /// The verifier now: of the CA file's content (the last good one when
    /// it cannot be read or built), or the fixed one.
    fn verifier(&self) -> Arc<WebPkiServerVerifier> {
        let (path, current) = match &self.roots {
            Roots::Fixed(verifier) => return verifier.clone(),
            Roots::File { path, current } => (path, current),
        };
        let mut current = current.lock();
        match std::fs::read(path) {
            Ok(content) if content != current.0 => {
                match crate::tls::roots(path).and_then(|r| verifier_of(r, &self.provider)) {
                    Ok(verifier) => {
                        tracing::info!(file = %path.display(), "the Redis CA file changed: new connections check servers against it");
                        *current = (content, verifier);
                    }
                    Err(e) => {
                        tracing::warn!(file = %path.display(), error = %format!("{e:#}"), "the Redis CA file changed and cannot be used: the previous one stays in use")
                    }
                }
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(file = %path.display(), error = %e, "the Redis CA file cannot be read: the previous one stays in use")
            }
        }
        current.1.clone()
    }
}

fn verifier_of(
    roots: rustls::RootCertStore,
    provider: &Arc<CryptoProvider>,
) -> anyhow::Result<Arc<WebPkiServerVerifier>> {
    Ok(WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone()).build()?)
}

impl ServerCertVerifier for ServerCheck {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        use rustls::CertificateError::{NotValidForName, NotValidForNameContext};
        match self.verifier().verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        ) {
            // the chain was checked; only the name did not match
            Err(rustls::Error::InvalidCertificate(
                NotValidForName | NotValidForNameContext { .. },
            )) if self.any_name => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.verifier().verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.verifier().verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// The client certificate and key as they are now: loaded again when
/// either file's content changes.
#[derive(Debug)]
pub(super) struct ClientCert {
    cert: PathBuf,
    key: PathBuf,
    provider: Arc<CryptoProvider>,
    /// The files' contents the key was built from, and the key.
    current: Mutex<(Vec<u8>, Vec<u8>, Arc<CertifiedKey>)>,
}

impl ClientCert {
    /// Reads both files now: a pair that cannot be used stops the start.
    pub(super) fn new(
        cert: &Path,
        key: &Path,
        provider: Arc<CryptoProvider>,
    ) -> anyhow::Result<Self> {
        let contents = (std::fs::read(cert)?, std::fs::read(key)?);
        let certified = certified_key(cert, key, &provider)?;
        Ok(Self {
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
            provider,
            current: Mutex::new((contents.0, contents.1, certified)),
        })
    }

    fn fresh(&self) -> Arc<CertifiedKey> {
        let mut current = self.current.lock();
        match (std::fs::read(&self.cert), std::fs::read(&self.key)) {
            (Ok(cert), Ok(key)) if cert != current.0 || key != current.1 => {
                match certified_key(&self.cert, &self.key, &self.provider) {
                    Ok(certified) => {
                        tracing::info!(cert = %self.cert.display(), key = %self.key.display(), "the Redis client certificate changed: new connections present it");
                        *current = (cert, key, certified);
                    }
                    // a certificate and a key written one after the other
                    // do not match for a moment: the next handshake retries
                    Err(e) => {
                        tracing::warn!(cert = %self.cert.display(), key = %self.key.display(), error = %format!("{e:#}"), "the Redis client certificate changed and cannot be used (yet): the previous one stays in use")
                    }
                }
            }
            (Ok(_), Ok(_)) => {}
            (Err(e), _) | (_, Err(e)) => {
                tracing::warn!(cert = %self.cert.display(), key = %self.key.display(), error = %e, "the Redis client certificate cannot be read: the previous one stays in use")
            }
        }
        current.2.clone()
    }
}

fn certified_key(
    cert: &Path,
    key: &Path,
    provider: &Arc<CryptoProvider>,
) -> anyhow::Result<Arc<CertifiedKey>> {
    let chain = crate::tls::certs(cert)?;
    let signing = provider
        .key_provider
        .load_private_key(crate::tls::private_key(key)?)?;
    let certified = CertifiedKey::new(chain, signing);
    certified.keys_match()?;
    Ok(Arc::new(certified))
}

impl ResolvesClientCert for ClientCert {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _sigschemes: &[SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        Some(self.fresh())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

//! TLS for `rediss://`: a rustls client configuration from the settings'
//! CA file and client certificate (the system's roots without a CA file),
//! the files read again for every new connection ([`super::tls_files`]).

use std::sync::Arc;

use super::tls_files::{CaFile, ClientCert};
use super::RedisSettings;

/// A rustls client configuration for `rediss://` from the settings' files.
pub(super) fn tls_client_config(
    settings: &RedisSettings,
) -> Result<Option<rustls::ClientConfig>, String> {
    if settings.ca_file.is_none()
        && settings.client_cert.is_none()
        && !settings.skip_hostname_verification
    {
        return Ok(None);
    }
    let build = || -> anyhow::Result<rustls::ClientConfig> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()?;
        let builder = match &settings.ca_file {
            // read again for every new connection (tls_files)
            Some(ca) => builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(CaFile::new(
                    ca,
                    provider.clone(),
                    settings.skip_hostname_verification,
                )?)),
            None => {
                let roots = rustls::RootCertStore {
                    roots: webpki_roots_or_empty(),
                };
                if settings.skip_hostname_verification {
                    let inner = rustls::client::WebPkiServerVerifier::builder_with_provider(
                        Arc::new(roots),
                        provider.clone(),
                    )
                    .build()?;
                    builder
                        .dangerous()
                        .with_custom_certificate_verifier(Arc::new(AnyName { inner }))
                } else {
                    builder.with_root_certificates(roots)
                }
            }
        };
        Ok(match &settings.client_cert {
            Some((cert, key)) => {
                builder.with_client_cert_resolver(Arc::new(ClientCert::new(cert, key, provider)?))
            }
            None => builder.with_no_client_auth(),
        })
    };
    build().map(Some).map_err(|e| format!("Redis TLS: {e:#}"))
}

/// A server verifier that checks the chain as `inner` does and takes it
/// for any name (`--redis-tls-skip-hostname-verification`).
#[derive(Debug)]
struct AnyName {
    inner: Arc<rustls::client::WebPkiServerVerifier>,
}

impl rustls::client::danger::ServerCertVerifier for AnyName {
    fn verify_server_cert(
        &self,
        end_entity: &rustls::pki_types::CertificateDer<'_>,
        intermediates: &[rustls::pki_types::CertificateDer<'_>],
        server_name: &rustls::pki_types::ServerName<'_>,
        ocsp_response: &[u8],
        now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        use rustls::CertificateError::{NotValidForName, NotValidForNameContext};
        match self.inner.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        ) {
            // the chain was checked; only the name did not match
            Err(rustls::Error::InvalidCertificate(
                NotValidForName | NotValidForNameContext { .. },
            )) => Ok(rustls::client::danger::ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// The system's root certificates, for a client certificate without a CA file.
fn webpki_roots_or_empty() -> Vec<rustls::pki_types::TrustAnchor<'static>> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_native_certs::load_native_certs().certs {
        let _ = roots.add(cert);
    }
    roots.roots
}

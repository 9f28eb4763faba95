//! TLS for `rediss://`: a rustls client configuration from the settings'
//! CA file and client certificate (the system's roots without a CA file),
//! the files read again for every new connection ([`super::tls_files`]).

use std::sync::Arc;

use super::tls_files::{ClientCert, ServerCheck};
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
        let any_name = settings.skip_hostname_verification;
        let builder = match &settings.ca_file {
            // read again for every new connection (tls_files)
            Some(ca) => builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(ServerCheck::from_file(
                    ca,
                    provider.clone(),
                    any_name,
                )?)),
            None => {
                let roots = rustls::RootCertStore {
                    roots: webpki_roots_or_empty(),
                };
                if any_name {
                    builder
                        .dangerous()
                        .with_custom_certificate_verifier(Arc::new(ServerCheck::fixed(
                            roots,
                            provider.clone(),
                            true,
                        )?))
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

/// The system's root certificates, for a client certificate without a CA file.
fn webpki_roots_or_empty() -> Vec<rustls::pki_types::TrustAnchor<'static>> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_native_certs::load_native_certs().certs {
        let _ = roots.add(cert);
    }
    roots.roots
}

//! TLS for `rediss://`: a rustls client configuration from the settings'
//! CA file and client certificate (the system's roots without a CA file).

use std::sync::Arc;

use super::RedisSettings;

/// A rustls client configuration for `rediss://` from the settings' files.
pub(super) fn tls_client_config(
    settings: &RedisSettings,
) -> Result<Option<rustls::ClientConfig>, String> {
    if settings.ca_file.is_none() && settings.client_cert.is_none() {
        return Ok(None);
    }
    let build = || -> anyhow::Result<rustls::ClientConfig> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?;
        let builder = match &settings.ca_file {
            Some(ca) => builder.with_root_certificates(crate::tls::roots(ca)?),
            None => builder.with_root_certificates(rustls::RootCertStore {
                roots: webpki_roots_or_empty(),
            }),
        };
        Ok(match &settings.client_cert {
            Some((cert, key)) => builder
                .with_client_auth_cert(crate::tls::certs(cert)?, crate::tls::private_key(key)?)?,
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

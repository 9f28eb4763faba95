//! TLS for the gRPC server, and mTLS when a client CA is given.
//!
//! The certificate chain, key and client CA are PEM files. They are checked
//! every two seconds and, when their contents change (a cert-manager renewal,
//! a rotated Kubernetes secret), a new configuration is built and used for new
//! connections; a change that does not load is logged and the previous
//! configuration keeps serving.
//!
//! A region proves its name with its client certificate: a DNS SAN
//! `<region>.regions.<domain>` ([`names_region`]).
//!
//! **Layer** (docs/architecture.md, "Layers", kept by `tests/layers.rs`): a
//! leaf: uses nothing of the crate.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use arc_swap::ArcSwap;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

const RELOAD_EVERY: Duration = Duration::from_secs(2);
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Where the server's TLS material lives.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// Clients must present a certificate signed by this CA (mTLS).
    pub client_ca: Option<PathBuf>,
    /// With `client_ca`: the client certificate must also carry this DNS
    /// subject alternative name.
    pub client_san: Option<String>,
    /// With `client_ca`: a client without a certificate is let in (the
    /// admin port's probes), a certificate it does present still checked;
    /// the server asks [`TlsPeer::certified`] per request.
    pub client_cert_optional: bool,
    /// The application protocols offered (ALPN): `h2` for gRPC,
    /// `http/1.1` for the admin port.
    pub alpn: &'static [&'static [u8]],
}

/// The identity of an admin connection, for its requests' handlers.
#[derive(Debug, Clone, Copy)]
pub struct TlsPeer {
    pub addr: std::net::SocketAddr,
    /// It presented a client certificate the client CA verified.
    pub certified: bool,
}

/// An HTTPS listener for axum: connections whose handshake succeeded
/// ([`ReloadingTls::incoming`]), each with its [`TlsPeer`].
pub struct TlsListener {
    local: std::net::SocketAddr,
    incoming: crate::connection_bounds::Connections<ServerTlsStream>,
    /// Dropped with the listener: the accepting task ends with it.
    _open: tokio::sync::watch::Sender<bool>,
}

/// Admin connections handshaking at once (each accepted one is axum's).
const ADMIN_HANDSHAKES: usize = 256;

impl TlsListener {
    pub fn new(tls: &Arc<ReloadingTls>, listener: TcpListener) -> std::io::Result<Self> {
        let local = listener.local_addr()?;
        let (open, closed) = tokio::sync::watch::channel(false);
        let bounds = crate::connection_bounds::ConnectionBounds::new(
            ADMIN_HANDSHAKES,
            1,
            Duration::ZERO,
            (Duration::from_secs(30), Duration::from_secs(20)),
        );
        Ok(Self {
            local,
            incoming: tls.incoming(listener, bounds, closed),
            _open: open,
        })
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = TlsPeer;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        use futures::StreamExt;
        loop {
            match self.incoming.next().await {
                // (its slot bounded the handshakes only)
                Some(crate::connection_bounds::Admitted { io: stream, .. }) => {
                    let (tcp, session) = stream.get_ref();
                    let peer = TlsPeer {
                        addr: tcp.peer_addr().unwrap_or(self.local),
                        certified: session.peer_certificates().is_some_and(|c| !c.is_empty()),
                    };
                    return (stream, peer);
                }
                // the accepting task ended (never, while the listener lives)
                None => std::future::pending::<()>().await,
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(TlsPeer {
            addr: self.local,
            certified: false,
        })
    }
}

impl axum::extract::connect_info::Connected<axum::serve::IncomingStream<'_, TlsListener>>
    for TlsPeer
{
    fn connect_info(stream: axum::serve::IncomingStream<'_, TlsListener>) -> Self {
        *stream.remote_addr()
    }
}

/// A gRPC connection over TLS, as the listener yields it.
pub type ServerTlsStream = TlsStream<TcpStream>;

/// The server's TLS configuration, swapped whole when its files change.
pub struct ReloadingTls {
    files: TlsFiles,
    config: ArcSwap<ServerConfig>,
}

impl ReloadingTls {
    pub fn load(files: TlsFiles) -> Result<Arc<Self>> {
        let config = build(&files)?;
        Ok(Arc::new(Self {
            files,
            config: ArcSwap::from_pointee(config),
        }))
    }

    /// Accepts TCP connections on `listener` within `bounds` (a slot
    /// first, held through the handshake) and yields those whose TLS
    /// handshake succeeded, until `stopped` (then the port closes).
    pub fn incoming(
        self: &Arc<Self>,
        listener: TcpListener,
        bounds: crate::connection_bounds::ConnectionBounds,
        mut stopped: tokio::sync::watch::Receiver<bool>,
    ) -> crate::connection_bounds::Connections<ServerTlsStream> {
        let (tx, rx) = tokio::sync::mpsc::channel(128);
        let this = self.clone();
        tokio::spawn(async move {
            loop {
                let next = async {
                    let slot = bounds.slot().await;
                    let conn = crate::connection_bounds::accept_with_backoff("gRPC TLS", || {
                        listener.accept()
                    })
                    .await;
                    (slot, conn)
                };
                let (slot, (tcp, peer)) = tokio::select! {
                    next = next => next,
                    _ = stopped.wait_for(|s| *s) => return,
                };
                let _ = tcp.set_nodelay(true);
                let acceptor = TlsAcceptor::from(this.config.load_full());
                let tx = tx.clone();
                tokio::spawn(async move {
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                        Ok(Ok(io)) => {
                            let _ = tx
                                .send(crate::connection_bounds::Admitted { io, slot })
                                .await;
                        }
                        Ok(Err(e)) if refused_certificate(&e) => {
                            tracing::warn!(%peer, error = %e, "TLS handshake refused: the client's certificate is not accepted (expired, not yet valid, or not signed by --tls-client-ca)")
                        }
                        Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                        Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                    }
                });
            }
        });
        Box::pin(futures::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|item| (item, rx))
        }))
    }

    /// Rebuilds the configuration whenever the files' contents change.
    pub fn spawn_reloader(self: &Arc<Self>) {
        let this = self.clone();
        tokio::spawn(async move {
            let mut seen = fingerprint(&this.files);
            loop {
                tokio::time::sleep(RELOAD_EVERY).await;
                let now = fingerprint(&this.files);
                if now == seen {
                    continue;
                }
                seen = now;
                match build(&this.files) {
                    Ok(config) => {
                        this.config.store(Arc::new(config));
                        tracing::info!(cert = %this.files.cert.display(), "TLS certificate reloaded");
                    }
                    Err(e) => {
                        tracing::error!(error = %format!("{e:#}"), "TLS files changed but do not load; the previous certificate keeps serving")
                    }
                }
            }
        });
    }
}

/// Whether a handshake failed on the peer's certificate.
fn refused_certificate(e: &std::io::Error) -> bool {
    e.get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        .is_some_and(|e| {
            matches!(
                e,
                rustls::Error::InvalidCertificate(_) | rustls::Error::NoCertificatesPresented
            )
        })
}

/// Whether the client certificate `chain` (its first, the end entity's)
/// names region `region`: a DNS subject alternative name
/// `<region>.regions.<domain>` (any domain, compared without case), as
/// docs/regions.md says to issue them.
pub fn names_region(chain: &[CertificateDer<'_>], region: &str) -> bool {
    let Some(leaf) = chain.first() else {
        return false;
    };
    let Ok(cert) = webpki::EndEntityCert::try_from(leaf) else {
        return false;
    };
    let prefix = format!("{}.regions.", region.to_ascii_lowercase());
    cert.valid_dns_names().any(|name| {
        let name = name.to_ascii_lowercase();
        name.strip_prefix(&prefix)
            .is_some_and(|domain| !domain.is_empty() && !domain.starts_with('.'))
    })
}

/// The subject alternative name a client certificate must carry
/// (`--tls-client-san`, envoyproxy/ratelimit's `GRPC_CLIENT_TLS_SAN`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientSan {
    /// A DNS name or an IP address, matched as a server's name is (Go's
    /// `VerifyOptions.DNSName`, which envoyproxy/ratelimit uses): without
    /// case, a certificate's `*.domain` covering one label, an address
    /// against the IP SANs.
    Name(rustls::pki_types::ServerName<'static>),
    /// A URI (`spiffe://cluster.local/ns/gw/sa/envoy`, as Istio's and
    /// SPIRE's certificates name a workload): the URI SAN, exactly.
    Uri(String),
}

impl ClientSan {
    /// Reads `--tls-client-san`; an error names the value.
    pub fn parse(value: &str) -> Result<Self> {
        if value.contains("://") {
            return Ok(Self::Uri(value.to_string()));
        }
        rustls::pki_types::ServerName::try_from(value.to_string())
            .map(Self::Name)
            .map_err(|_| {
                anyhow::anyhow!(
                    "--tls-client-san {value:?}: not a DNS name, an IP address or a URI (spiffe://…)"
                )
            })
    }

    /// Whether certificate `leaf` carries it.
    fn named_by(&self, leaf: &CertificateDer<'_>) -> bool {
        let Ok(cert) = webpki::EndEntityCert::try_from(leaf) else {
            return false;
        };
        match self {
            Self::Name(name) => cert.verify_is_valid_for_subject_name(name).is_ok(),
            Self::Uri(uri) => cert.valid_uri_names().any(|n| n == uri),
        }
    }
}

/// A client verifier that also requires a subject alternative name
/// (envoyproxy/ratelimit's `GRPC_CLIENT_TLS_SAN`): the chain is checked by
/// `inner`, then the leaf must carry `san`.
#[derive(Debug)]
struct SanVerifier {
    inner: Arc<dyn rustls::server::danger::ClientCertVerifier>,
    san: ClientSan,
}

impl rustls::server::danger::ClientCertVerifier for SanVerifier {
    fn offer_client_auth(&self) -> bool {
        self.inner.offer_client_auth()
    }

    fn client_auth_mandatory(&self) -> bool {
        self.inner.client_auth_mandatory()
    }

    fn root_hint_subjects(&self) -> &[rustls::DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::server::danger::ClientCertVerified, rustls::Error> {
        let verified = self
            .inner
            .verify_client_cert(end_entity, intermediates, now)?;
        if self.san.named_by(end_entity) {
            Ok(verified)
        } else {
            Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::NotValidForName,
            ))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

fn fingerprint(files: &TlsFiles) -> u64 {
    let mut h = DefaultHasher::new();
    for path in [
        Some(&files.cert),
        Some(&files.key),
        files.client_ca.as_ref(),
    ]
    .into_iter()
    .flatten()
    {
        std::fs::read(path).ok().hash(&mut h);
    }
    h.finish()
}

/// Every certificate in a PEM file; an error names the file.
pub fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_file_iter(path)
        .with_context(|| format!("{}: cannot read certificates", path.display()))?
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("{}: invalid PEM certificate", path.display()))?;
    if certs.is_empty() {
        bail!("{}: no certificate in the file", path.display());
    }
    Ok(certs)
}

/// The private key in a PEM file; an error names the file.
pub fn private_key(path: &Path) -> Result<PrivateKeyDer<'static>> {
    PrivateKeyDer::from_pem_file(path)
        .with_context(|| format!("{}: no usable private key", path.display()))
}

/// A store of the CA certificates in a PEM file.
pub fn roots(path: &Path) -> Result<RootCertStore> {
    let mut roots = RootCertStore::empty();
    for cert in certs(path)? {
        roots
            .add(cert)
            .with_context(|| format!("{}: not a usable CA certificate", path.display()))?;
    }
    Ok(roots)
}

fn build(files: &TlsFiles) -> Result<ServerConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let chain = certs(&files.cert)?;
    let key = private_key(&files.key)?;
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .context("TLS protocol versions")?;
    let builder = match (&files.client_ca, &files.client_san) {
        (Some(ca), san) => {
            let verifier =
                WebPkiClientVerifier::builder_with_provider(Arc::new(roots(ca)?), provider);
            let verifier = if files.client_cert_optional {
                verifier.allow_unauthenticated()
            } else {
                verifier
            };
            let verifier = verifier
                .build()
                .with_context(|| format!("{}: cannot verify clients with it", ca.display()))?;
            match san {
                Some(san) => builder.with_client_cert_verifier(Arc::new(SanVerifier {
                    inner: verifier,
                    san: ClientSan::parse(san)?,
                })),
                None => builder.with_client_cert_verifier(verifier),
            }
        }
        (None, Some(_)) => bail!("a client SAN to check needs a client CA (--tls-client-ca)"),
        (None, None) => builder.with_no_client_auth(),
    };
    let mut config = builder.with_single_cert(chain, key).with_context(|| {
        format!(
            "{} and {} do not make a usable identity",
            files.cert.display(),
            files.key.display()
        )
    })?;
    config.alpn_protocols = files.alpn.iter().map(|p| p.to_vec()).collect();
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::ClientSan;

    #[test]
    fn a_client_san_is_read_as_a_name_an_address_or_a_uri() {
        let kind = |v: &str| match ClientSan::parse(v) {
            Ok(ClientSan::Name(rustls::pki_types::ServerName::DnsName(_))) => "dns",
            Ok(ClientSan::Name(rustls::pki_types::ServerName::IpAddress(_))) => "ip",
            Ok(ClientSan::Uri(_)) => "uri",
            Ok(_) => "other",
            Err(_) => "refused",
        };
        assert_eq!(kind("envoy.edge.test"), "dns");
        assert_eq!(kind("Envoy.Edge.Test"), "dns");
        assert_eq!(kind("10.1.2.3"), "ip");
        assert_eq!(kind("::1"), "ip");
        assert_eq!(kind("spiffe://cluster.local/ns/gw/sa/envoy"), "uri");
        assert_eq!(kind("not a name!"), "refused");
        assert_eq!(kind(""), "refused");
    }
}

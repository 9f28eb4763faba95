//! Who may read and who may change what on the admin port
//! (docs/security.md):
//!
//! - [`headers`]: every answer says not to be sniffed, framed, cached or
//!   referred, and the page runs under a content security policy that
//!   allows only its own script and style.
//! - [`host`]: the pages and JSON answer only a `Host` that is an address,
//!   `localhost`, or a name given with `--admin-allowed-hosts`: a page of
//!   another site whose name was made to resolve here (DNS rebinding)
//!   gets a 421.
//! - [`credential`]: with `--admin-token-file`, `Authorization: Bearer
//!   <token>` (the scheme in any case); with `--admin-tls-client-ca`, a
//!   client certificate that CA signed.
//! - [`operator`]: what changes state needs an operator credential to be
//!   configured at all (else 403, whoever asks), an `X-Rls-Operator`
//!   header naming who asks (a browser sends no such header to another
//!   origin without a preflight, which this port never grants), and an
//!   `Origin`, when one is sent, of this very host.

use std::net::IpAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::extract::{ConnectInfo, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::AdminState;
use crate::tls::TlsPeer;

/// The header that names the operator of a state-changing call.
pub const OPERATOR_HEADER: &str = "x-rls-operator";

/// What the page may load: its own script and style, its own JSON.
const PAGE_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; \
     frame-ancestors 'none'";

/// Security headers on every answer of the admin port.
pub(super) async fn headers(request: Request, next: Next) -> Response {
    let mut response = next.run(request).await;
    let h = response.headers_mut();
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(PAGE_POLICY),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.entry(header::CACHE_CONTROL)
        .or_insert(HeaderValue::from_static("no-store"));
    response
}

/// The host part of a `Host` header's value (`[::1]:8080` → `::1`).
fn host_name(value: &str) -> &str {
    if let Some(rest) = value.strip_prefix('[') {
        return rest.split(']').next().unwrap_or("");
    }
    match value.rsplit_once(':') {
        Some((host, port)) if port.bytes().all(|b| b.is_ascii_digit()) => host,
        _ => value,
    }
}

/// Whether `host` (a `Host` header's value) may be answered: an IP
/// address, `localhost` (or a name under it), or one of `allowed` (`*`:
/// any). Pure.
pub fn host_allowed(host: &str, allowed: &[String]) -> bool {
    let name = host_name(host).trim_end_matches('.').to_ascii_lowercase();
    if name.is_empty() {
        return false;
    }
    name.parse::<IpAddr>().is_ok()
        || name == "localhost"
        || name.ends_with(".localhost")
        || allowed
            .iter()
            .any(|a| a == "*" || a.trim_end_matches('.').eq_ignore_ascii_case(&name))
}

/// Refuses a request whose `Host` this port does not answer (421).
pub(super) async fn host(
    State(state): State<AdminState>,
    request: Request,
    next: Next,
) -> Response {
    let host = request
        .headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .or_else(|| request.uri().authority().map(|a| a.as_str()))
        .unwrap_or("");
    if host_allowed(host, &state.allowed_hosts) {
        return next.run(request).await;
    }
    (
        StatusCode::MISDIRECTED_REQUEST,
        "this admin port answers an address, localhost or a name of --admin-allowed-hosts\n",
    )
        .into_response()
}

/// The token `Authorization` carries, if its scheme is Bearer (in any
/// case, RFC 9110 §11.1).
pub fn bearer_token(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.trim_start().split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// `a == b`, in time that depends on their lengths alone.
fn same_bytes(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The token in `file`: its content, trimmed; `None` when it cannot be
/// read or is blank.
pub fn read_token(file: &Path) -> Option<String> {
    let token = std::fs::read_to_string(file).ok()?;
    let token = token.trim();
    (!token.is_empty()).then(|| token.to_string())
}

/// The Unix second of the last warning that the token file could not be
/// read: at most one a minute, whatever the requests.
static TOKEN_WARNED: AtomicU64 = AtomicU64::new(0);

fn warn_token_unreadable(file: &Path) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let last = TOKEN_WARNED.load(Ordering::Relaxed);
    if now >= last + 60
        && TOKEN_WARNED
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    {
        tracing::warn!(file = %file.display(), "--admin-token-file cannot be read or is empty: the guarded admin paths are refused (logged at most once a minute)");
    }
}

/// With `--admin-tls-client-ca`: the connection presented a certificate
/// that CA signed, else 403. With `--admin-token-file`: the request's
/// bearer token is the file's (read now: a rotated Secret applies at
/// once), else 401. A file that cannot be read refuses every request
/// (503, neither the file nor its content named).
pub(super) async fn credential(
    State(state): State<AdminState>,
    request: Request,
    next: Next,
) -> Response {
    if state.client_cert_required && !certified(&request) {
        return (
            StatusCode::FORBIDDEN,
            "a client certificate signed by --admin-tls-client-ca is needed\n",
        )
            .into_response();
    }
    let Some(file) = &state.token_file else {
        return next.run(request).await;
    };
    let Some(token) = read_token(file) else {
        warn_token_unreadable(file);
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "the admin token cannot be read: see the service's log\n",
        )
            .into_response();
    };
    if bearer_token(request.headers()).is_some_and(|g| same_bytes(g.as_bytes(), token.as_bytes())) {
        return next.run(request).await;
    }
    (
        StatusCode::UNAUTHORIZED,
        [(header::WWW_AUTHENTICATE, "Bearer")],
        "a bearer token is needed (--admin-token-file)\n",
    )
        .into_response()
}

fn certified(request: &Request) -> bool {
    request
        .extensions()
        .get::<ConnectInfo<TlsPeer>>()
        .is_some_and(|peer| peer.0.certified)
}

/// Why a state-changing call is refused, if it is: no operator credential
/// is configured, no operator is named, or the call came from a page of
/// another origin. Pure.
pub fn operator_refusal(state_has_credential: bool, headers: &HeaderMap) -> Option<&'static str> {
    if !state_has_credential {
        return Some(
            "changing state needs an operator credential: start the service with --admin-token-file or --admin-tls-client-ca\n",
        );
    }
    let named = headers
        .get(OPERATOR_HEADER)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| !v.trim().is_empty());
    if !named {
        return Some("name the operator in an X-Rls-Operator header\n");
    }
    if let Some(origin) = headers.get(header::ORIGIN) {
        let host = headers
            .get(header::HOST)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        let origin = origin.to_str().unwrap_or("");
        let same = ["http://", "https://"]
            .iter()
            .any(|scheme| origin.strip_prefix(scheme) == Some(host));
        if !same {
            return Some("a call from a page of another origin is refused\n");
        }
    }
    None
}

/// Refuses a state-changing call [`operator_refusal`] refuses (403); the
/// credential itself was checked by [`credential`] before.
pub(super) async fn operator(
    State(state): State<AdminState>,
    request: Request,
    next: Next,
) -> Response {
    let configured = state.token_file.is_some() || state.client_cert_required;
    match operator_refusal(configured, request.headers()) {
        None => next.run(request).await,
        Some(why) => (StatusCode::FORBIDDEN, why).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_str(v).expect("value"));
        }
        h
    }

    #[test]
    fn hosts_answered_are_addresses_localhost_and_those_allowed() {
        let none: Vec<String> = vec![];
        for ok in [
            "127.0.0.1:8080",
            "[::1]:8080",
            "10.1.2.3",
            "localhost:8080",
            "LOCALHOST",
            "a.localhost:1",
        ] {
            assert!(host_allowed(ok, &none), "{ok}");
        }
        for refused in [
            "evil.example:8080",
            "",
            "localhost.evil.example",
            "127.0.0.1.evil.example",
        ] {
            assert!(!host_allowed(refused, &none), "{refused}");
        }
        let allowed = vec!["rls.internal".to_string()];
        assert!(host_allowed("RLS.internal:8080", &allowed));
        assert!(host_allowed("anything:1", &["*".to_string()]));
    }

    #[test]
    fn the_bearer_scheme_is_read_in_any_case() {
        for v in ["Bearer t0k", "bearer t0k", "BEARER  t0k "] {
            assert_eq!(
                bearer_token(&headers(&[("authorization", v)])),
                Some("t0k"),
                "{v}"
            );
        }
        assert_eq!(
            bearer_token(&headers(&[("authorization", "Basic t0k")])),
            None
        );
    }

    #[test]
    fn a_state_change_needs_a_credential_an_operator_and_this_origin() {
        let good = headers(&[("x-rls-operator", "alice"), ("host", "127.0.0.1:8080")]);
        assert!(
            operator_refusal(false, &good).is_some(),
            "no credential configured"
        );
        assert_eq!(operator_refusal(true, &good), None);
        assert!(operator_refusal(true, &headers(&[("host", "127.0.0.1:8080")])).is_some());
        let cross = headers(&[
            ("x-rls-operator", "alice"),
            ("host", "127.0.0.1:8080"),
            ("origin", "http://evil.example"),
        ]);
        assert!(operator_refusal(true, &cross).is_some());
        let same = headers(&[
            ("x-rls-operator", "alice"),
            ("host", "127.0.0.1:8080"),
            ("origin", "http://127.0.0.1:8080"),
        ]);
        assert_eq!(operator_refusal(true, &same), None);
        let null = headers(&[("x-rls-operator", "a"), ("host", "h"), ("origin", "null")]);
        assert!(operator_refusal(true, &null).is_some());
    }
}

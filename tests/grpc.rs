//! ShouldRateLimit over real gRPC: a server on a loopback port and a tonic
//! client, asserting codes, limits, remaining tokens, reset times, headers,
//! hits_addend and every INVALID_ARGUMENT case; plus the admin endpoints.

mod common;

use common::{descriptor, request, rules_dir, serve_args};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::UInt64Value;
use tokenbucket_rls::cli::HeaderFormat;
use tokenbucket_rls::server::{self, RunningServer};
use tonic::transport::Channel;

const RULES: &str = r#"
domain: api
descriptors:
  - key: api_key
    rate_limit: {unit: minute, requests_per_unit: 6, burst: 5, name: keys}
  - key: weighted
    rate_limit: {unit: minute, requests_per_unit: 6, burst: 10}
  - key: free
    rate_limit: {unlimited: true}
  - key: tenant
    value: acme
    descriptors:
      - key: user
        rate_limit: {unit: minute, requests_per_unit: 2}
  - key: shadow
    shadow_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: quota
    quota_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: block
    rate_limit: {unit: second, requests_per_unit: 0}
  - key: login
    limits:
      - {unit: minute, requests_per_unit: 6, burst: 3, name: login-burst}
      - {unit: hour, requests_per_unit: 10, name: login-hourly}
"#;

struct Harness {
    server: Option<RunningServer>,
    client: RateLimitServiceClient<Channel>,
    _rules: tempfile::TempDir,
}

impl Harness {
    async fn start_with(response_headers: Option<HeaderFormat>) -> Self {
        let rules = rules_dir(RULES);
        let mut args = serve_args(rules.path().to_path_buf());
        args.response_headers = response_headers.is_some();
        args.response_headers_format = response_headers.unwrap_or_default();
        let server = server::start(&args).await.expect("server starts");
        let client = RateLimitServiceClient::connect(format!("http://{}", server.grpc_addr))
            .await
            .expect("client connects");
        Self {
            server: Some(server),
            client,
            _rules: rules,
        }
    }

    async fn start() -> Self {
        Self::start_with(None).await
    }

    async fn call(&mut self, req: RateLimitRequest) -> Result<RateLimitResponse, tonic::Status> {
        self.client
            .should_rate_limit(req)
            .await
            .map(|r| r.into_inner())
    }

    async fn ok(&mut self, req: RateLimitRequest) -> RateLimitResponse {
        self.call(req).await.expect("call succeeds")
    }

    fn admin(&self, path: &str) -> String {
        let addr = self.server.as_ref().expect("running").admin_addr;
        format!("http://{addr}{path}")
    }
}

fn header<'a>(resp: &'a RateLimitResponse, key: &str) -> Option<&'a str> {
    resp.response_headers_to_add
        .iter()
        .find(|h| h.key == key)
        .map(|h| h.value.as_str())
}

#[tokio::test]
async fn burst_then_over_limit_with_retry_after() {
    let mut h = Harness::start().await;
    for i in 0..5u32 {
        let r = h
            .ok(request("api", vec![descriptor(&[("api_key", "k1")])]))
            .await;
        assert_eq!(r.overall_code, Code::Ok as i32, "request {i}");
        let s = &r.statuses[0];
        assert_eq!(s.code, Code::Ok as i32);
        let limit = s.current_limit.as_ref().expect("current_limit");
        assert_eq!(
            (limit.name.as_str(), limit.requests_per_unit, limit.unit),
            ("keys", 6, 2)
        );
        assert_eq!(s.limit_remaining, 4 - i);
        // time until full: (i + 1) tokens at 6/min
        assert_eq!(
            s.duration_until_reset.as_ref().map(|d| d.seconds),
            Some(10 * (i64::from(i) + 1))
        );
        assert!(header(&r, "retry-after").is_none());
    }
    let r = h
        .ok(request("api", vec![descriptor(&[("api_key", "k1")])]))
        .await;
    assert_eq!(r.overall_code, Code::OverLimit as i32);
    assert_eq!(r.statuses[0].code, Code::OverLimit as i32);
    assert_eq!(r.statuses[0].limit_remaining, 0);
    assert_eq!(
        r.statuses[0]
            .duration_until_reset
            .as_ref()
            .map(|d| d.seconds),
        Some(10)
    );
    assert_eq!(header(&r, "retry-after"), Some("10"));
    // another key has its own bucket
    let r = h
        .ok(request("api", vec![descriptor(&[("api_key", "k2")])]))
        .await;
    assert_eq!(r.overall_code, Code::Ok as i32);
}

#[tokio::test]
async fn hits_addend_from_request_and_descriptor() {
    let mut h = Harness::start().await;
    let mut req = request("api", vec![descriptor(&[("weighted", "a")])]);
    req.hits_addend = 4;
    let r = h.ok(req.clone()).await;
    assert_eq!(r.statuses[0].limit_remaining, 6);
    // the descriptor's own hits_addend wins over the request's
    let mut d = descriptor(&[("weighted", "a")]);
    d.hits_addend = Some(UInt64Value { value: 5 });
    let r = h.ok(request("api", vec![d.clone()])).await;
    assert_eq!(r.statuses[0].limit_remaining, 1);
    // 0 on the descriptor: a check that spends nothing
    d.hits_addend = Some(UInt64Value { value: 0 });
    let r = h.ok(request("api", vec![d.clone()])).await;
    assert_eq!(r.overall_code, Code::Ok as i32);
    assert_eq!(r.statuses[0].limit_remaining, 1);
    // 4 more than the 1 left: over the limit, retry after 3 tokens at 6/min
    let r = h.ok(req).await;
    assert_eq!(r.overall_code, Code::OverLimit as i32);
    assert_eq!(header(&r, "retry-after"), Some("30"));
    // more than the burst can ever hold: rejected with no retry time
    d.hits_addend = Some(UInt64Value { value: 11 });
    let r = h.ok(request("api", vec![d])).await;
    assert_eq!(r.overall_code, Code::OverLimit as i32);
    assert!(header(&r, "retry-after").is_none());
    // no wait can be told: the unit's window end, as envoyproxy/ratelimit
    // always says one
    let reset = r.statuses[0].duration_until_reset.as_ref().expect("set");
    assert!((1..=60).contains(&reset.seconds), "{reset:?}");
}

#[tokio::test]
async fn unlimited_unknown_nested_shadow_and_blocked() {
    let mut h = Harness::start().await;
    for _ in 0..20 {
        let r = h
            .ok(request(
                "api",
                vec![
                    descriptor(&[("free", "x")]),
                    descriptor(&[("nothing", "x")]),
                    descriptor(&[("tenant", "other"), ("user", "u")]),
                ],
            ))
            .await;
        assert_eq!(r.overall_code, Code::Ok as i32);
        assert_eq!(r.statuses[0].limit_remaining, u32::MAX, "unlimited");
        assert!(r.statuses.iter().all(|s| s.current_limit.is_none()));
    }
    let r = h
        .ok(request(
            "unknown-domain",
            vec![descriptor(&[("api_key", "k")])],
        ))
        .await;
    assert_eq!(r.overall_code, Code::Ok as i32);
    assert!(r.statuses[0].current_limit.is_none());

    let acme = || {
        request(
            "api",
            vec![descriptor(&[("tenant", "acme"), ("user", "u1")])],
        )
    };
    assert_eq!(h.ok(acme()).await.overall_code, Code::Ok as i32);
    assert_eq!(h.ok(acme()).await.overall_code, Code::Ok as i32);
    let r = h.ok(acme()).await;
    assert_eq!(r.overall_code, Code::OverLimit as i32);
    assert_eq!(header(&r, "retry-after"), Some("30"), "one token at 2/min");

    let shadow = || request("api", vec![descriptor(&[("shadow", "s")])]);
    for _ in 0..3 {
        let r = h.ok(shadow()).await;
        assert_eq!(r.overall_code, Code::Ok as i32, "shadow mode never rejects");
        assert_eq!(r.statuses[0].code, Code::Ok as i32);
    }
    let r = h
        .ok(request("api", vec![descriptor(&[("block", "b")])]))
        .await;
    assert_eq!(r.overall_code, Code::OverLimit as i32);
    assert!(header(&r, "retry-after").is_none(), "r = 0: no retry time");
}

#[tokio::test]
async fn quota_mode_reports_violations_and_refuses_once_every_quota_is_over() {
    let mut h = Harness::start().await;
    let req = || {
        request(
            "api",
            vec![descriptor(&[("free", "x")]), descriptor(&[("quota", "q")])],
        )
    };
    let r = h.ok(req()).await;
    let meta = r.dynamic_metadata.expect("quota metadata");
    assert!(meta.fields.contains_key("quotaModeEnabled"));
    let r = h.ok(req()).await;
    // its only quota-mode descriptor is over: none has room (as
    // envoyproxy/ratelimit decides), and the status says which
    assert_eq!(r.overall_code, Code::OverLimit as i32);
    assert_eq!(r.statuses[1].code, Code::OverLimit as i32);
    let meta = r.dynamic_metadata.expect("quota metadata");
    let violations = format!("{:?}", meta.fields.get("quotaModeViolations"));
    assert!(violations.contains("NumberValue(1.0)"), "{violations}");
}

#[tokio::test]
async fn one_descriptor_over_refuses_the_request_and_the_others_are_given_back() {
    let mut h = Harness::start().await;
    let req = || {
        request(
            "api",
            vec![
                descriptor(&[("api_key", "both")]),
                descriptor(&[("block", "b")]),
            ],
        )
    };
    let r = h.ok(req()).await;
    assert_eq!(r.overall_code, Code::OverLimit as i32);
    assert_eq!(r.statuses[0].code, Code::Ok as i32);
    assert_eq!(
        r.statuses[0].limit_remaining, 5,
        "the other descriptor was given back what it took"
    );
    assert_eq!(r.statuses[1].code, Code::OverLimit as i32);
    let alone = h
        .ok(request("api", vec![descriptor(&[("api_key", "both")])]))
        .await;
    assert_eq!(alone.statuses[0].limit_remaining, 4, "one spend: its own");
}

#[tokio::test]
async fn several_limits_on_one_descriptor() {
    let mut h = Harness::start().await;
    let login = || request("api", vec![descriptor(&[("login", "/")])]);
    for left in [2, 1, 0] {
        let r = h.ok(login()).await;
        assert_eq!(r.overall_code, Code::Ok as i32);
        let s = &r.statuses[0];
        assert_eq!(
            s.current_limit.as_ref().map(|l| l.name.as_str()),
            Some("login-burst")
        );
        assert_eq!(s.limit_remaining, left);
    }
    let r = h.ok(login()).await;
    assert_eq!(r.overall_code, Code::OverLimit as i32);
    assert_eq!(
        r.statuses[0]
            .current_limit
            .as_ref()
            .map(|l| l.name.as_str()),
        Some("login-burst")
    );
}

#[tokio::test]
async fn sixty_four_descriptors_are_decided() {
    let mut h = Harness::start().await;
    let values: Vec<String> = (0..64).map(|i| format!("k{i}")).collect();
    let descriptors = values
        .iter()
        .map(|v| descriptor(&[("api_key", v)]))
        .collect();
    let r = h.ok(request("api", descriptors)).await;
    assert_eq!(r.statuses.len(), 64);
    assert!(r.statuses.iter().all(|s| s.limit_remaining == 4));
}

#[tokio::test]
async fn bad_requests_are_invalid_argument_and_store_nothing() {
    let mut h = Harness::start().await;
    let long = "x".repeat(1025);
    let mut empty_entries = descriptor(&[]);
    empty_entries.entries.clear();
    let mut bad_unit = descriptor(&[("api_key", "o")]);
    bad_unit.limit = Some(Default::default());
    let cases: Vec<(RateLimitRequest, &str)> = vec![
        (request("", vec![descriptor(&[("api_key", "k")])]), "domain"),
        (request("api", vec![]), "no descriptors"),
        (request("api", vec![empty_entries]), "no entries"),
        (request("api", vec![descriptor(&[("", "v")])]), "empty key"),
        (
            request(
                "api",
                (0..65).map(|_| descriptor(&[("api_key", "k")])).collect(),
            ),
            "65 descriptors",
        ),
        (
            request(
                "api",
                vec![descriptor(
                    &(0..33).map(|_| ("api_key", "k")).collect::<Vec<_>>(),
                )],
            ),
            "33 entries",
        ),
        (
            request("api", vec![descriptor(&[(long.as_str(), "v")])]),
            "key is longer",
        ),
        (request("api", vec![bad_unit]), "limit.unit"),
    ];
    for (req, expected) in cases {
        // a valid descriptor rides along: it must not be charged either
        let mut req = req;
        if !req.domain.is_empty() && !req.descriptors.is_empty() && req.descriptors.len() < 64 {
            req.descriptors
                .insert(0, descriptor(&[("api_key", "bystander")]));
        }
        let err = h.call(req).await.expect_err("rejected");
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{expected}");
        assert!(
            err.message().contains(expected),
            "{expected:?} in {:?}",
            err.message()
        );
    }
    let r = h
        .ok(request(
            "api",
            vec![descriptor(&[("api_key", "bystander")])],
        ))
        .await;
    assert_eq!(
        r.statuses[0].limit_remaining, 4,
        "nothing was spent by rejected requests"
    );
}

#[tokio::test]
async fn request_limit_override() {
    let mut h = Harness::start().await;
    let mut d = descriptor(&[("api_key", "ov")]);
    d.limit = Some(envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride {
        requests_per_unit: 2,
        unit: 2, // MINUTE
    });
    for _ in 0..2 {
        let r = h.ok(request("api", vec![d.clone()])).await;
        assert_eq!(r.overall_code, Code::Ok as i32);
        assert_eq!(
            r.statuses[0]
                .current_limit
                .as_ref()
                .map(|l| (l.requests_per_unit, l.unit)),
            Some((2, 2))
        );
    }
    let r = h.ok(request("api", vec![d])).await;
    assert_eq!(r.overall_code, Code::OverLimit as i32);
    assert_eq!(header(&r, "retry-after"), Some("30"));
}

/// `--response-headers`: the current IETF draft's structured fields for
/// the descriptor closest to its limit (its policy: the burst, refilled in
/// full over `w` seconds; its state: tokens left and seconds until full, or
/// until a retry can pass), or with `--response-headers-format legacy` the
/// older `RateLimit-Limit/Remaining/Reset`.
#[tokio::test]
async fn rate_limit_headers_when_asked() {
    let both = || {
        request(
            "api",
            vec![
                descriptor(&[("api_key", "h")]),
                descriptor(&[("weighted", "h")]),
            ],
        )
    };
    let mut h = Harness::start_with(Some(HeaderFormat::Draft)).await;
    let r = h.ok(both()).await;
    // keys: burst 5 at 6 a minute (50 s to refill), 4 left, full in 10 s
    assert_eq!(
        header(&r, "ratelimit-policy"),
        Some("\"keys\";q=5;w=50"),
        "the key bucket has fewer left"
    );
    assert_eq!(header(&r, "ratelimit"), Some("\"keys\";r=4;t=10"));
    assert_eq!(header(&r, "ratelimit-limit"), None);
    for _ in 0..4 {
        h.ok(request("api", vec![descriptor(&[("api_key", "h")])]))
            .await;
    }
    let r = h
        .ok(request("api", vec![descriptor(&[("api_key", "h")])]))
        .await;
    assert_eq!(r.overall_code, Code::OverLimit as i32);
    assert_eq!(
        header(&r, "ratelimit"),
        Some("\"keys\";r=0;t=10"),
        "a retry in 10 s"
    );
    // an unnamed limit is named by its rule's path
    let r = h
        .ok(request("api", vec![descriptor(&[("weighted", "w")])]))
        .await;
    assert_eq!(
        header(&r, "ratelimit-policy"),
        Some("\"weighted\";q=10;w=100")
    );

    let mut h = Harness::start_with(Some(HeaderFormat::Legacy)).await;
    let r = h.ok(both()).await;
    assert_eq!(header(&r, "ratelimit-limit"), Some("6"));
    assert_eq!(header(&r, "ratelimit-remaining"), Some("4"));
    assert_eq!(header(&r, "ratelimit-reset"), Some("10"));
    assert_eq!(header(&r, "ratelimit-policy"), None);

    // their names, as envoyproxy/ratelimit's LIMIT_*_HEADER set them
    let rules = rules_dir(RULES);
    let mut args = serve_args(rules.path().to_path_buf());
    args.response_headers = true;
    args.response_headers_format = HeaderFormat::Legacy;
    args.legacy_header_names = ["X-Limit", "X-Left", "X-Reset"].map(String::from).to_vec();
    let server = server::start(&args).await.expect("server starts");
    let mut c = RateLimitServiceClient::connect(format!("http://{}", server.grpc_addr))
        .await
        .expect("client connects");
    let r = c.should_rate_limit(both()).await.expect("ok").into_inner();
    assert_eq!(header(&r, "x-limit"), Some("6"));
    assert_eq!(header(&r, "x-left"), Some("4"));
    assert_eq!(header(&r, "x-reset"), Some("10"));
    assert_eq!(header(&r, "ratelimit-limit"), None);
    server.shutdown().await.expect("stop");
    args.legacy_header_names = vec!["X-Limit".into()];
    let err = server::start(&args).await.err().expect("two names missing");
    assert!(err.to_string().contains("three header names"), "{err}");
}

#[tokio::test]
async fn admin_endpoints_answer() {
    let h = Harness::start().await;
    let get = |path: &str| {
        let url = h.admin(path);
        async move {
            let r = reqwest::get(url).await.expect("admin answers");
            (r.status().as_u16(), r.text().await.expect("body"))
        }
    };
    assert_eq!(get("/healthz").await.0, 200);
    let (code, body) = get("/readyz").await;
    assert_eq!(code, 200);
    assert!(body.contains("generation 1"), "{body}");
    let (code, body) = get("/config").await;
    assert_eq!(code, 200);
    let json: serde_json::Value = serde_json::from_str(&body).expect("json");
    assert_eq!(json["generation"], 1);
    assert_eq!(json["domains"][0]["domain"], "api");
    assert!(json["files"][0]["path"]
        .as_str()
        .is_some_and(|p| p.ends_with("rules.yaml")));
}

#[tokio::test]
async fn graceful_shutdown_stops_serving() {
    let mut h = Harness::start().await;
    h.ok(request("api", vec![descriptor(&[("api_key", "s")])]))
        .await;
    let server = h.server.take().expect("running");
    let addr = server.grpc_addr;
    server.shutdown().await.expect("clean shutdown");
    assert!(RateLimitServiceClient::connect(format!("http://{addr}"))
        .await
        .is_err());
}

#[tokio::test]
async fn requests_over_one_mebibyte_are_refused_before_decoding() {
    let mut h = Harness::start().await;
    // 64 descriptors × 20 entries of 1 KiB keys: valid entry by entry, 1.3 MiB in all.
    let key = "k".repeat(1024);
    let descriptors = (0..64)
        .map(|_| descriptor(&(0..20).map(|_| (key.as_str(), "v")).collect::<Vec<_>>()))
        .collect();
    let err = h
        .call(request("api", descriptors))
        .await
        .expect_err("too large");
    assert!(
        matches!(
            err.code(),
            tonic::Code::OutOfRange | tonic::Code::ResourceExhausted
        ),
        "{err:?}"
    );
    // and the server is fine afterwards
    let r = h
        .ok(request("api", vec![descriptor(&[("api_key", "after")])]))
        .await;
    assert_eq!(r.statuses[0].limit_remaining, 4);
}

#[tokio::test]
async fn negative_hits_refund_tokens_up_to_the_burst() {
    let mut h = Harness::start().await;
    let mut spend = request("api", vec![descriptor(&[("api_key", "refund")])]);
    spend.hits_addend = 3;
    let r = h.ok(spend).await;
    assert_eq!(r.statuses[0].limit_remaining, 2);
    let mut refund = descriptor(&[("api_key", "refund")]);
    refund.is_negative_hits = true;
    refund.hits_addend = Some(UInt64Value { value: 2 });
    let r = h.ok(request("api", vec![refund.clone()])).await;
    assert_eq!(r.overall_code, Code::Ok as i32);
    assert_eq!(r.statuses[0].limit_remaining, 4, "two tokens came back");
    refund.hits_addend = Some(UInt64Value { value: 100 });
    let r = h.ok(request("api", vec![refund])).await;
    assert_eq!(r.statuses[0].limit_remaining, 5, "never above the burst");
}

/// envoyproxy/ratelimit's service-wide modes: `SHADOW_MODE` (over the
/// limit answered OK, statuses still over, counted), `QUOTA_MODE` (every
/// limit soft, reported), and `RESPONSE_DYNAMIC_METADATA` (the request and
/// the passing rules' `metadata` in the dynamic metadata).
#[tokio::test]
async fn shadow_quota_and_dynamic_metadata_modes() {
    use envoy_types::pb::google::protobuf::value::Kind;
    let rules = rules_dir(
        r#"
domain: api
descriptors:
  - key: svc
    value: one
    rate_limit: {unit: hour, requests_per_unit: 1}
    metadata: {service_with_quota: {name: service_1}, weight: 3}
  - key: svc
    value: two
    rate_limit: {unit: hour, requests_per_unit: 5}
    metadata: {service_with_quota: {name: service_2, zone: b}}
"#,
    );
    let start = |shadow: bool, quota: bool| {
        let mut args = serve_args(rules.path().to_path_buf());
        args.shadow_mode = shadow;
        args.quota_mode = quota;
        args.response_dynamic_metadata = true;
        async move {
            let server = server::start(&args).await.expect("server starts");
            let client = RateLimitServiceClient::connect(format!("http://{}", server.grpc_addr))
                .await
                .expect("client connects");
            (server, client)
        }
    };
    let req = || {
        let mut two = descriptor(&[("svc", "two")]);
        two.hits_addend = Some(UInt64Value { value: 2 });
        let mut r = request("api", vec![descriptor(&[("svc", "one")]), two]);
        r.hits_addend = 1;
        r
    };

    // shadow mode: the second request is over "one", answered OK
    let (server, mut c) = start(true, false).await;
    let first = c.should_rate_limit(req()).await.expect("ok").into_inner();
    assert_eq!(first.overall_code, Code::Ok as i32);
    let meta = first.dynamic_metadata.expect("dynamic metadata");
    let text = format!("{meta:?}");
    assert_eq!(
        meta.fields["domain"].kind,
        Some(Kind::StringValue("api".into()))
    );
    assert!(text.contains("StringValue(\"svc=one\")"), "{text}");
    assert!(
        text.contains("NumberValue(2.0)"),
        "the descriptor's hitsAddend: {text}"
    );
    assert_eq!(meta.fields["hitsAddend"].kind, Some(Kind::NumberValue(1.0)));
    // both passed: their metadata merged, the first's name kept
    let merged = format!("{:?}", meta.fields["metadata"]);
    assert!(
        merged.contains("service_1") && merged.contains("zone") && !merged.contains("service_2"),
        "{merged}"
    );
    let second = c.should_rate_limit(req()).await.expect("ok").into_inner();
    assert_eq!(
        second.overall_code,
        Code::Ok as i32,
        "shadow mode refuses nothing"
    );
    assert_eq!(
        second.statuses[0].code,
        Code::OverLimit as i32,
        "still says so"
    );
    assert!(
        second
            .response_headers_to_add
            .iter()
            .all(|h| h.key != "retry-after"),
        "nothing to retry"
    );
    // only "two" passed now: its metadata alone
    let merged = format!(
        "{:?}",
        second.dynamic_metadata.expect("meta").fields["metadata"]
    );
    assert!(
        merged.contains("service_2") && !merged.contains("service_1"),
        "{merged}"
    );
    let text = reqwest::get(format!("http://{}/metrics", server.admin_addr))
        .await
        .expect("scrape")
        .text()
        .await
        .expect("text");
    assert!(text.contains("rls_global_shadow_mode_total 1"), "{text}");
    server.shutdown().await.expect("stop");

    // quota mode: every limit soft, the violation reported
    let (server, mut c) = start(false, true).await;
    c.should_rate_limit(req()).await.expect("ok");
    let second = c.should_rate_limit(req()).await.expect("ok").into_inner();
    assert_eq!(second.overall_code, Code::Ok as i32);
    let meta = format!(
        "{:?}",
        second.dynamic_metadata.expect("meta").fields["quotaModeViolations"]
    );
    assert!(meta.contains("NumberValue(0.0)"), "{meta}");
    server.shutdown().await.expect("stop");
}

/// `rls-bench` against a running service: its HTTP/2 client decodes every
/// answer (exact OK and OVER_LIMIT counts on one hot key) and reports its
/// own CPU per request.
#[tokio::test]
async fn rls_bench_counts_answers_exactly() {
    let rules = rules_dir(
        "domain: bench\ndescriptors:\n  - key: key\n    rate_limit: {unit: hour, requests_per_unit: 100, burst: 100}\n",
    );
    let server = server::start(&serve_args(rules.path().to_path_buf()))
        .await
        .expect("server starts");
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_rls-bench"))
        .args([
            "--target",
            &format!("http://{}", server.grpc_addr),
            "--requests",
            "500",
            "--connections",
            "2",
            "--concurrency",
            "4",
            "--warmup",
            "0s",
            "--duration",
            "60s",
            "--json",
        ])
        .output()
        .await
        .expect("rls-bench runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(report["requests"], 500);
    assert_eq!(report["ok"], 100, "the burst");
    assert_eq!(report["over_limit"], 400);
    assert_eq!(report["errors"], 0);
    assert_eq!(report["with_limit"], 500);
    assert!(report["client_cpu_us"].as_f64().is_some(), "{report}");
    server.shutdown().await.expect("stop");
}

/// A value over 1 KiB (a client's own 2 KiB `x-request-id`, a long path)
/// is decided by its digest on its own descriptor (issue 51: it failed the
/// whole call, and Envoy's failure mode answered for every limit of the
/// request): the same long value spends one bucket, another its own.
#[tokio::test]
async fn a_long_value_is_decided_by_its_digest() {
    let mut h = Harness::start().await;
    let (long_a, long_b) = ("a".repeat(2048), "b".repeat(2048));
    let mut remaining = Vec::new();
    for value in [&long_a, &long_a, &long_b] {
        let r = h
            .ok(request(
                "api",
                vec![
                    descriptor(&[("api_key", value.as_str())]),
                    descriptor(&[("api_key", "beside-long")]),
                ],
            ))
            .await;
        assert_eq!(r.overall_code, Code::Ok as i32);
        remaining.push((r.statuses[0].limit_remaining, r.statuses[1].limit_remaining));
    }
    assert_eq!(remaining, [(4, 4), (3, 3), (4, 2)]);
}

/// A value that is not UTF-8 (Envoy copies header bytes as they came) is
/// decided with each invalid byte as `\xNN`, not failed as a whole call
/// (`INTERNAL`, then every limit of the request answered by Envoy's
/// failure mode: a bypass with `failure_mode_deny: false`).
#[tokio::test]
async fn a_value_that_is_not_utf8_is_decided_not_failed() {
    use prost::Message;
    let h = Harness::start().await;
    let addr = h.server.as_ref().expect("running").grpc_addr;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .connect()
        .await
        .expect("connects");
    // a valid request, then the placeholder's bytes swapped for ones that
    // are not UTF-8 (same length: the framing stands)
    let wire = |value: &[u8]| {
        let mut bytes = request(
            "api",
            vec![
                descriptor(&[("api_key", "@@@@")]),
                descriptor(&[("api_key", "beside-utf8")]),
            ],
        )
        .encode_to_vec();
        let at = bytes
            .windows(4)
            .position(|w| w == b"@@@@")
            .expect("placeholder");
        bytes[at..at + 4].copy_from_slice(value);
        bytes
    };
    let mut answers = Vec::new();
    for value in [b"\xff\xfe\xfd\xfc", b"\xff\xfe\xfd\xfc", b"ok\xc3\x28"] {
        let mut grpc = tonic::client::Grpc::new(channel.clone());
        grpc.ready().await.expect("ready");
        let r = grpc
            .unary(
                tonic::Request::new(wire(value)),
                tonic::codegen::http::uri::PathAndQuery::from_static(
                    "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
                ),
                RawCodec,
            )
            .await
            .expect("decided, not failed")
            .into_inner();
        assert_eq!(r.overall_code, Code::Ok as i32);
        answers.push((r.statuses[0].limit_remaining, r.statuses[1].limit_remaining));
    }
    assert_eq!(
        answers,
        [(4, 4), (3, 3), (4, 2)],
        "each value its own bucket"
    );
}

/// Sends bytes as they are; reads the answer as prost.
#[derive(Clone, Copy, Default)]
struct RawCodec;

impl tonic::codec::Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = RateLimitResponse;
    type Encoder = RawCodec;
    type Decoder = RawCodec;
    fn encoder(&mut self) -> Self::Encoder {
        RawCodec
    }
    fn decoder(&mut self) -> Self::Decoder {
        RawCodec
    }
}

impl tonic::codec::Encoder for RawCodec {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn encode(
        &mut self,
        item: Vec<u8>,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        use prost::bytes::BufMut;
        dst.put_slice(&item);
        Ok(())
    }
}

impl tonic::codec::Decoder for RawCodec {
    type Item = RateLimitResponse;
    type Error = tonic::Status;
    fn decode(
        &mut self,
        src: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<RateLimitResponse>, tonic::Status> {
        use prost::Message;
        RateLimitResponse::decode(src)
            .map(Some)
            .map_err(|e| tonic::Status::internal(e.to_string()))
    }
}

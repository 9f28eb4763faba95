//! Several regions sharing one global budget (`scope: global`): a global
//! tier (the service's binary, its own process, memory store) and three
//! regions (each the binary as a process of its own, with its own
//! redis-server), each reaching the global tier through a
//! TCP proxy the test controls, so that one region's link can be cut and
//! healed. Loopback only; every load loop is bounded in count and time.
//!
//! The rule under test: B = 60 tokens, r = 30 a second, N = 3 regions.
//! What is asserted is what the README promises: the world admits at most
//! B + r·t (a share's rounding only lowers it), at least 70 % of r·t under
//! heavy demand, a loud region gets most of it, and a region cut off keeps
//! its share until it expires, then its `failure_mode` (local: B/N, r/N).

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::redis::RedisServer;
use common::{
    descriptor, free_port, listening, request, rules_dir, sample, serve_args, ChildGuard,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use tokio::net::{TcpListener, TcpStream};
use tonic::transport::Channel;

const B: u64 = 60;
const R: u64 = 30;

const RULES: &str = r#"
domain: world
descriptors:
  - key: api
    scope: global
    failure_mode: local
    rate_limit: {unit: second, requests_per_unit: 30, burst: 60}
  - key: strict
    scope: global
    failure_mode: closed
    rate_limit: {unit: second, requests_per_unit: 30, burst: 60}
  - key: lax
    scope: global
    failure_mode: open
    rate_limit: {unit: second, requests_per_unit: 30, burst: 60}
  - key: user
    scope: global
    rate_limit: {unit: second, requests_per_unit: 30, burst: 60}
  - key: local
    rate_limit: {unit: second, requests_per_unit: 1, burst: 5}
"#;

/// A TCP proxy from a loopback port to `target`; `cut` drops every
/// connection it carries and refuses new ones until `heal`.
struct Link {
    port: u16,
    open: Arc<AtomicBool>,
    generation: Arc<AtomicU64>,
}

impl Link {
    async fn start(target: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let open = Arc::new(AtomicBool::new(true));
        let generation = Arc::new(AtomicU64::new(0));
        let (o, g) = (open.clone(), generation.clone());
        tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                if !o.load(Ordering::SeqCst) {
                    drop(inbound);
                    continue;
                }
                let (o, g) = (o.clone(), g.clone());
                tokio::spawn(async move {
                    let born = g.load(Ordering::SeqCst);
                    let Ok(outbound) = TcpStream::connect(("127.0.0.1", target)).await else {
                        return;
                    };
                    let (mut ri, mut wi) = inbound.into_split();
                    let (mut ro, mut wo) = outbound.into_split();
                    let copy = async {
                        tokio::select! {
                            _ = tokio::io::copy(&mut ri, &mut wo) => {},
                            _ = tokio::io::copy(&mut ro, &mut wi) => {},
                        }
                    };
                    let cut = async {
                        while o.load(Ordering::SeqCst) && g.load(Ordering::SeqCst) == born {
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                    };
                    tokio::select! {
                        _ = copy => {},
                        _ = cut => {},
                    }
                });
            }
        });
        Self {
            port,
            open,
            generation,
        }
    }

    fn cut(&self) {
        self.open.store(false, Ordering::SeqCst);
        self.generation.fetch_add(1, Ordering::SeqCst);
    }

    fn heal(&self) {
        self.open.store(true, Ordering::SeqCst);
    }
}

/// A region: the service's binary on its own redis-server.
struct Region {
    _process: ChildGuard,
    admin: u16,
    _redis: RedisServer,
}

struct World {
    _global: ChildGuard,
    global_admin: u16,
    regions: Vec<Region>,
    links: Vec<Link>,
    clients: Vec<RateLimitServiceClient<Channel>>,
    _rules: tempfile::TempDir,
}

async fn world() -> World {
    let rules = rules_dir(RULES);
    let (grpc, admin) = (free_port(), free_port());
    let global = ChildGuard(
        common::binary_without_rls_env()
            .args(["--config"])
            .arg(rules.path())
            .args([
                "--grpc-addr",
                &format!("127.0.0.1:{grpc}"),
                "--admin-addr",
                &format!("127.0.0.1:{admin}"),
            ])
            .env("RUST_LOG", "warn")
            .spawn()
            .expect("global tier starts"),
    );
    listening(grpc).await;
    let mut regions = Vec::new();
    let mut links = Vec::new();
    let mut clients = Vec::new();
    for name in ["eu", "us", "ap"] {
        let link = Link::start(grpc).await;
        let redis = RedisServer::standalone();
        let (region_grpc, region_admin) = (free_port(), free_port());
        let process = ChildGuard(
            common::binary_without_rls_env()
                .args(["--config"])
                .arg(rules.path())
                .args([
                    "--grpc-addr",
                    &format!("127.0.0.1:{region_grpc}"),
                    "--admin-addr",
                    &format!("127.0.0.1:{region_admin}"),
                    "--store",
                    "redis",
                    "--redis-url",
                    &redis.url(),
                    "--quota-upstream",
                    &format!("http://127.0.0.1:{}", link.port),
                    "--region",
                    name,
                    "--regions",
                    "3",
                ])
                .env("RUST_LOG", "warn")
                .spawn()
                .expect("region starts"),
        );
        listening(region_grpc).await;
        clients.push(
            RateLimitServiceClient::connect(format!("http://127.0.0.1:{region_grpc}"))
                .await
                .expect("connect"),
        );
        regions.push(Region {
            _process: process,
            admin: region_admin,
            _redis: redis,
        });
        links.push(link);
    }
    World {
        _global: global,
        global_admin: admin,
        regions,
        links,
        clients,
        _rules: rules,
    }
}

/// What one region's caller saw.
#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    ok: u64,
    over: u64,
    unavailable: u64,
}

/// Sends `key=value` requests to a region every `every`, for `duration`;
/// each call waits for its answer (a bounded loop: at most duration/every).
async fn load(
    mut client: RateLimitServiceClient<Channel>,
    key: &'static str,
    value: &'static str,
    every: Duration,
    duration: Duration,
) -> Tally {
    let mut t = Tally::default();
    let start = Instant::now();
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    while start.elapsed() < duration {
        tick.tick().await;
        match client
            .should_rate_limit(request("world", vec![descriptor(&[(key, value)])]))
            .await
        {
            Ok(r) if r.get_ref().overall_code == Code::Ok as i32 => t.ok += 1,
            Ok(_) => t.over += 1,
            Err(_) => t.unavailable += 1,
        }
    }
    t
}

/// Loads all three regions at once (`every` per region) for `duration`.
async fn load_all(
    w: &World,
    key: &'static str,
    every: [Duration; 3],
    duration: Duration,
) -> Vec<Tally> {
    let tasks: Vec<_> = (0..3)
        .map(|i| tokio::spawn(load(w.clients[i].clone(), key, "k", every[i], duration)))
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.expect("load task"));
    }
    out
}

async fn metrics(region: &Region) -> String {
    reqwest::get(format!("http://127.0.0.1:{}/metrics", region.admin))
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text")
}

/// Waits until `f` holds on the region's metrics, for at most `within`.
async fn until_metric(region: &Region, within: Duration, f: impl Fn(&str) -> bool) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if f(&metrics(region).await) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

/// Waits until the region reports its link to the global tier up (or
/// down), for at most `within`.
async fn until_upstream(region: &Region, up: bool, within: Duration) -> bool {
    let want = if up { 1.0 } else { 0.0 };
    until_metric(region, within, |m| {
        sample(m, "rls_region_upstream_up") == Some(want)
    })
    .await
}

/// `GET path` on the admin port `admin`, as JSON.
async fn admin_json(admin: u16, path: &str) -> serde_json::Value {
    let body = reqwest::get(format!("http://127.0.0.1:{admin}{path}"))
        .await
        .expect("admin answers")
        .text()
        .await
        .expect("body");
    serde_json::from_str(&body).expect("JSON")
}

fn total(t: &[Tally]) -> u64 {
    t.iter().map(|t| t.ok).sum()
}

const FAST: Duration = Duration::from_millis(5);
const SLOW: Duration = Duration::from_millis(250);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn regions_share_one_budget_split_by_demand_and_bounded_through_a_partition() {
    let w = world().await;

    // 0. A region's first request on a bucket is decided at once from its
    //    floor, before any share: admitted, also on a rule failing closed
    //    (the global tier keeps B/N for every region not in the split).
    for c in &w.clients {
        let first = load(c.clone(), "strict", "first", FAST, Duration::from_millis(1)).await;
        assert_eq!((first.ok, first.over, first.unavailable), (1, 0, 0));
    }

    // 1. Heavy demand everywhere: the world admits at most B + r·t, and at
    //    least 70 % of r·t once the shares are in place.
    let window = Duration::from_secs(6);
    let started = Instant::now();
    let tallies = load_all(&w, "api", [FAST; 3], window).await;
    let secs = started.elapsed().as_secs_f64();
    let admitted = total(&tallies);
    let bound = B as f64 + R as f64 * secs;
    assert!(
        admitted as f64 <= bound,
        "admitted {admitted} > B + r·t = {bound:.0} over {secs:.1}s: {tallies:?}"
    );
    assert!(
        admitted as f64 >= 0.7 * R as f64 * 6.0,
        "admitted {admitted} < 70 % of r·t: {tallies:?}"
    );
    // each region holds a share (the global tier answered all three)
    for r in &w.regions {
        let m = metrics(r).await;
        assert_eq!(sample(&m, "rls_region_upstream_up"), Some(1.0), "{m}");
        assert!(sample(&m, "rls_region_assignments_total").unwrap_or(0.0) >= 1.0);
        assert!(sample(&m, "rls_region_reports_total").unwrap_or(0.0) >= 1.0);
    }

    // 2. Skewed demand: the loud region gets most of the budget, once the
    //    demand each region reports (smoothed over reports) has moved and
    //    the quiet regions' larger shares have expired.
    let _ = load_all(&w, "api", [FAST, SLOW, SLOW], Duration::from_secs(8)).await;
    let tallies = load_all(&w, "api", [FAST, SLOW, SLOW], Duration::from_secs(5)).await;
    assert!(
        tallies[0].ok > 2 * (tallies[1].ok + tallies[2].ok),
        "the loud region should get most: {tallies:?}"
    );
    assert!(tallies[0].ok as f64 <= B as f64 + R as f64 * 5.5);

    // 3. A regional rule beside the global one: each region has its own
    //    burst of 5, whatever the others spent.
    let tallies = load_all(&w, "local", [FAST; 3], Duration::from_millis(500)).await;
    for t in &tallies {
        assert!(
            (5..=6).contains(&t.ok),
            "regional burst 5 (+1 refill) each: {tallies:?}"
        );
    }

    // 4. A per-key global rule: one budget per user worldwide. A user
    //    flooding every region does not touch another's budget, whose
    //    first requests are decided at once (the floor) and reported.
    let flood: Vec<_> = (0..3)
        .map(|i| {
            tokio::spawn(load(
                w.clients[i].clone(),
                "user",
                "alice",
                FAST,
                Duration::from_secs(3),
            ))
        })
        .collect();
    let bob = load(
        w.clients[0].clone(),
        "user",
        "bob",
        SLOW,
        Duration::from_secs(3),
    )
    .await;
    let mut alice = 0;
    for f in flood {
        alice += f.await.expect("flood").ok;
    }
    assert!(
        bob.ok >= 12 && bob.over == 0 && bob.unavailable == 0,
        "bob is within his own budget: {bob:?}"
    );
    assert!(
        alice as f64 <= B as f64 + R as f64 * 3.5,
        "alice's one budget worldwide: {alice}"
    );
    let m = metrics(&w.regions[0]).await;
    assert!(
        sample(&m, "rls_region_buckets").unwrap_or(0.0) >= 3.0,
        "{m}"
    );

    // 5. The region "ap" is cut off from the global tier. It
    //    keeps its share until it expires, then fails local: B/N, r/N.
    w.links[2].cut();
    assert!(
        until_upstream(&w.regions[2], false, Duration::from_secs(10)).await,
        "the cut region should notice"
    );
    let started = Instant::now();
    let tallies = load_all(&w, "api", [FAST; 3], Duration::from_secs(8)).await;
    let secs = started.elapsed().as_secs_f64();
    let admitted = total(&tallies);
    let bound = B as f64 + R as f64 * secs;
    assert!(
        admitted as f64 <= bound,
        "through the partition: admitted {admitted} > {bound:.0}: {tallies:?}"
    );
    // cut off, its share expired: the floor decided (B/N = 20, r/N = 10/s)
    let m = metrics(&w.regions[2]).await;
    assert!(
        sample(&m, "rls_region_fallback_total{mode=\"floor\"}").unwrap_or(0.0) > 0.0,
        "{m}"
    );
    assert!(
        tallies[2].ok as f64 <= 20.0 + 10.0 * secs + 1.0 && tallies[2].ok > 0,
        "cut off, ap spends at most its share then B/N, r/N: {tallies:?}"
    );
    // the two connected regions split at most 2/3 of the budget: B/N stays with ap
    let connected = tallies[0].ok + tallies[1].ok;
    assert!(
        connected as f64 <= 2.0 * (20.0 + 10.0 * secs) + 1.0,
        "the connected regions keep B/N out for the cut one: {tallies:?}"
    );
    // a closed rule refuses once the share is gone, an open one admits all
    let strict = load(
        w.clients[2].clone(),
        "strict",
        "k",
        FAST,
        Duration::from_millis(300),
    )
    .await;
    assert!(strict.unavailable > 0 && strict.ok == 0, "{strict:?}");
    let lax = load(
        w.clients[2].clone(),
        "lax",
        "k",
        FAST,
        Duration::from_millis(300),
    )
    .await;
    assert!(
        lax.ok > 0 && lax.over == 0 && lax.unavailable == 0,
        "{lax:?}"
    );

    // 6. Healed: the region is back in the split within a few intervals.
    w.links[2].heal();
    assert!(until_upstream(&w.regions[2], true, Duration::from_secs(10)).await);
    let _ = load_all(&w, "api", [FAST; 3], Duration::from_secs(3)).await;
    let m = metrics(&w.regions[2]).await;
    let since = sample(&m, "rls_region_seconds_since_assignment").unwrap_or(-1.0);
    assert!(
        (0.0..3.0).contains(&since),
        "a fresh assignment after healing: {since}\n{m}"
    );
    let share = sample(
        &m,
        "rls_region_share{domain=\"world\",part=\"burst\",rule=\"api\"}",
    );
    assert!(share.is_some_and(|s| s > 0.0), "{m}");

    // the global tier sees three regions' streams
    let global = reqwest::get(format!("http://127.0.0.1:{}/metrics", w.global_admin))
        .await
        .expect("global metrics")
        .text()
        .await
        .expect("text");
    assert!(
        sample(&global, "rls_quota_streams").unwrap_or(0.0) >= 3.0,
        "{global}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_frozen_global_tier_leaves_every_region_on_its_floor_and_a_thawed_one_heals() {
    let w = world().await;
    let _ = load_all(&w, "api", [FAST; 3], Duration::from_secs(3)).await;
    let pid = w._global.0.id().to_string();
    let signal = |s: &str| {
        std::process::Command::new("kill")
            .args([s, &pid])
            .status()
            .expect("kill");
    };
    // frozen: it accepts nothing and answers nothing, its sockets stay open
    signal("-STOP");
    for r in &w.regions {
        assert!(
            until_upstream(r, false, Duration::from_secs(15)).await,
            "every region notices a frozen global tier (HTTP/2 pings unanswered)"
        );
    }
    // the admin page's JSON says so (#54 item 2)
    let page = admin_json(w.regions[0].admin, "/v1/regions").await;
    assert_eq!(page["region"]["upstream_reachable"], false, "{page}");
    // shares expired: every region at B/N, r/N, the world at B + r·t
    let started = Instant::now();
    let tallies = load_all(&w, "api", [FAST; 3], Duration::from_secs(5)).await;
    let secs = started.elapsed().as_secs_f64();
    let admitted = total(&tallies);
    assert!(
        admitted as f64 <= B as f64 + R as f64 * secs,
        "frozen: {admitted} over {secs:.1}s: {tallies:?}"
    );
    for t in &tallies {
        assert!(t.ok > 0, "each region still admits its floor: {tallies:?}");
    }
    signal("-CONT");
    for r in &w.regions {
        assert!(until_upstream(r, true, Duration::from_secs(15)).await);
    }
    // each region's JSON: a region of 3, the global tier reachable, its
    // global bucket held; the global tier's: the 3 regions reporting
    for r in &w.regions {
        let page = admin_json(r.admin, "/v1/regions").await;
        assert_eq!(page["region"]["regions"], 3, "{page}");
        assert_eq!(page["region"]["upstream_reachable"], true, "{page}");
        assert!(page["global_tier"].is_null(), "{page}");
    }
    let mut reporting = Vec::new();
    for _ in 0..50 {
        let page = admin_json(w.global_admin, "/v1/regions").await;
        reporting = page["global_tier"]["regions_reporting"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        if reporting.len() == 3 {
            assert_eq!(page["global_tier"]["regions_expected"], 3, "{page}");
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(reporting.len(), 3, "{reporting:?}");
    // within two report intervals of reporting again, each has a share
    let _ = load_all(&w, "api", [FAST; 3], Duration::from_secs(2)).await;
    for r in &w.regions {
        let m = metrics(r).await;
        let since = sample(&m, "rls_region_seconds_since_assignment").unwrap_or(-1.0);
        assert!((0.0..2.0).contains(&since), "{since}\n{m}");
    }
}

#[tokio::test]
async fn the_global_tier_refuses_a_region_that_counts_the_regions_differently() {
    use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
    use envoy_types::pb::envoy::service::rate_limit_quota::v3::RateLimitQuotaUsageReports;
    let rules = rules_dir(RULES);
    let global = tokenbucket_rls::server::start(&serve_args(rules.path().to_path_buf()))
        .await
        .expect("global tier");
    let open = |region: &'static str, regions: &'static str| {
        let addr = global.grpc_addr;
        async move {
            let mut client = RateLimitQuotaServiceClient::connect(format!("http://{addr}"))
                .await
                .expect("connect");
            let report = RateLimitQuotaUsageReports {
                domain: "world".into(),
                bucket_quota_usages: Vec::new(),
            };
            let mut request = tonic::Request::new(
                futures::stream::iter([report]).chain(futures::stream::pending()),
            );
            request
                .metadata_mut()
                .insert("x-rls-region", region.parse().expect("ascii"));
            request
                .metadata_mut()
                .insert("x-rls-regions", regions.parse().expect("ascii"));
            let mut answers = client
                .stream_rate_limit_quotas(request)
                .await
                .expect("stream")
                .into_inner();
            tokio::time::timeout(Duration::from_secs(2), answers.message()).await
        }
    };
    use futures::StreamExt;
    // the first region's count stands (its stream stays open, unanswered)
    let first = tokio::spawn(open("eu", "3"));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let refused = open("us", "4").await.expect("answered at once");
    let status = refused.expect_err("refused");
    assert_eq!(status.code(), tonic::Code::FailedPrecondition);
    assert!(status.message().contains("--regions 4"), "{status}");
    assert!(status.message().contains("said 3"), "{status}");
    first.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_regions_instances_spend_one_share_in_the_regions_store() {
    let rules = rules_dir(RULES);
    // the global tier on the Redis store (its own Envoys' buckets would be
    // split through the shared ledger; the regions' split is its own)
    let global_redis = RedisServer::standalone();
    let global =
        common::start_on_redis(&global_redis.url(), &rules, Duration::from_millis(500)).await;
    let eu_redis = RedisServer::standalone();
    let us_redis = RedisServer::standalone();
    let region = |name: &str, redis: &RedisServer| {
        let mut args = serve_args(rules.path().to_path_buf());
        args.store = tokenbucket_rls::cli::StoreKind::Redis;
        args.redis_url = Some(redis.url());
        args.quota_upstream = Some(format!("http://{}", global.grpc_addr));
        args.region = Some(name.to_owned());
        args.regions = Some(2);
        args
    };
    // two instances of eu on eu's Redis, one of us on its own
    let mut servers = Vec::new();
    for (name, redis) in [("eu", &eu_redis), ("eu", &eu_redis), ("us", &us_redis)] {
        servers.push(
            tokenbucket_rls::server::start(&region(name, redis))
                .await
                .expect("region instance"),
        );
    }
    let mut clients = Vec::new();
    for s in &servers {
        clients.push(
            RateLimitServiceClient::connect(format!("http://{}", s.grpc_addr))
                .await
                .expect("connect"),
        );
    }
    let run = |secs: u64| {
        let tasks: Vec<_> = clients
            .iter()
            .map(|c| tokio::spawn(load(c.clone(), "api", "k", FAST, Duration::from_secs(secs))))
            .collect();
        async move {
            let mut out = Vec::new();
            for t in tasks {
                out.push(t.await.expect("load"));
            }
            out
        }
    };
    let _ = run(3).await;
    let started = Instant::now();
    let tallies = run(6).await;
    let secs = started.elapsed().as_secs_f64();
    let admitted = total(&tallies);
    // each eu instance holding the region's share on its own would admit
    // about a third more than the budget
    assert!(
        admitted as f64 <= B as f64 + R as f64 * secs,
        "{admitted} over {secs:.1}s: {tallies:?}"
    );
    assert!(admitted as f64 >= 0.7 * R as f64 * 6.0, "{tallies:?}");
    // eu's two instances report as one member: demand summed, so eu (twice
    // the callers) gets more than us
    let eu = tallies[0].ok + tallies[1].ok;
    assert!(eu > tallies[2].ok, "{tallies:?}");
    // shares came from the global tier (not floors for want of one)
    for s in &servers {
        let m = reqwest::get(format!("http://{}/metrics", s.admin_addr))
            .await
            .expect("metrics")
            .text()
            .await
            .expect("text");
        assert!(
            sample(&m, "rls_region_assignments_total").unwrap_or(0.0) >= 1.0,
            "{m}"
        );
        assert_eq!(sample(&m, "rls_region_upstream_up"), Some(1.0));
    }
}

/// A region instance in this process: `name`, one of `regions`, on the
/// memory store, reporting to the global tier at `tier`.
async fn region_here(
    rules: &tempfile::TempDir,
    tier: std::net::SocketAddr,
    name: &str,
    regions: u32,
) -> tokenbucket_rls::server::RunningServer {
    let mut args = serve_args(rules.path().to_path_buf());
    args.quota_upstream = Some(format!("http://{tier}"));
    args.region = Some(name.to_owned());
    args.regions = Some(regions);
    tokenbucket_rls::server::start(&args)
        .await
        .expect("region instance")
}

/// `rls_region_upstream_up` of a region in this process.
fn upstream_up(s: &tokenbucket_rls::server::RunningServer) -> Option<f64> {
    sample(&s.metrics.render(), "rls_region_upstream_up")
}

/// A region refused for counting the regions differently is unreachable
/// for as long as it is refused (before, its link showed up most of the
/// time, as each reconnect's health check passed, and a `closed` rule
/// served floors instead of its failure mode); once the regions that
/// counted otherwise are gone, the global tier forgets their count and
/// takes it (before, it remembered the first count until it restarted).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_refused_region_is_unreachable_until_the_global_tier_takes_it() {
    let rules = rules_dir(RULES);
    let tier = tokenbucket_rls::server::start(&serve_args(rules.path().to_path_buf()))
        .await
        .expect("global tier");
    let eu = region_here(&rules, tier.grpc_addr, "eu", 2).await;
    let mut eu_client = RateLimitServiceClient::connect(format!("http://{}", eu.grpc_addr))
        .await
        .expect("connect");
    // eu's stream opens with its first demand
    let eu_load = tokio::spawn(load(
        eu_client.clone(),
        "strict",
        "k",
        SLOW,
        Duration::from_secs(6),
    ));
    let deadline = Instant::now() + Duration::from_secs(10);
    while sample(&eu.metrics.render(), "rls_region_assignments_total").unwrap_or(0.0) < 1.0 {
        assert!(Instant::now() < deadline, "eu never got an assignment");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let us = region_here(&rules, tier.grpc_addr, "us", 3).await;
    let us_client = RateLimitServiceClient::connect(format!("http://{}", us.grpc_addr))
        .await
        .expect("connect");
    let us_load = tokio::spawn(load(
        us_client.clone(),
        "strict",
        "k",
        SLOW,
        Duration::from_secs(12),
    ));
    let deadline = Instant::now() + Duration::from_secs(10);
    // refused once it reported (the gauge reads 0 before anything too)
    while upstream_up(&us) != Some(0.0)
        || sample(&us.metrics.render(), "rls_region_reports_total").unwrap_or(0.0) < 1.0
    {
        assert!(Instant::now() < deadline, "us was never refused");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // refused: down for as long as it is refused
    let mut up_samples = 0;
    for _ in 0..30 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if upstream_up(&us) == Some(1.0) {
            up_samples += 1;
        }
    }
    assert_eq!(
        up_samples,
        0,
        "a refused region counted its link up: {}",
        us.metrics
            .render()
            .lines()
            .filter(|l| l.starts_with("rls_region"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    // eu leaves: the count goes with it, us is taken
    eu_load.abort();
    eu.shutdown().await.expect("eu stops");
    let deadline = Instant::now() + Duration::from_secs(15);
    while upstream_up(&us) != Some(1.0)
        || sample(&us.metrics.render(), "rls_region_assignments_total").unwrap_or(0.0) < 1.0
    {
        assert!(
            Instant::now() < deadline,
            "us was never taken once eu left: {}",
            us.metrics.render()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    us_load.abort();
    let _ = eu_client
        .should_rate_limit(request("world", vec![descriptor(&[("strict", "k")])]))
        .await;
}

/// A busy region (a call every 5 ms) and a quiet one (every 500 ms) on one
/// global rule of burst `b` and `r` a second, failing closed; 4 s of
/// warm-up, then 10 s counted: what each was admitted, and the seconds.
async fn small_budget(b: u64, r: u64) -> (Tally, Tally, f64) {
    let rules = rules_dir(&format!(
        "domain: world\ndescriptors:\n  - key: small\n    scope: global\n    failure_mode: closed\n    rate_limit: {{unit: second, requests_per_unit: {r}, burst: {b}}}\n"
    ));
    let tier = tokenbucket_rls::server::start(&serve_args(rules.path().to_path_buf()))
        .await
        .expect("global tier");
    let busy = region_here(&rules, tier.grpc_addr, "busy", 2).await;
    let quiet = region_here(&rules, tier.grpc_addr, "quiet", 2).await;
    let client = |s: &tokenbucket_rls::server::RunningServer| {
        RateLimitServiceClient::connect(format!("http://{}", s.grpc_addr))
    };
    let (bc, qc) = (
        client(&busy).await.expect("connect"),
        client(&quiet).await.expect("connect"),
    );
    let quietly = Duration::from_millis(500);
    let warm = (
        tokio::spawn(load(bc.clone(), "small", "k", FAST, Duration::from_secs(4))),
        tokio::spawn(load(
            qc.clone(),
            "small",
            "k",
            quietly,
            Duration::from_secs(4),
        )),
    );
    let _ = (warm.0.await, warm.1.await);
    let started = Instant::now();
    let run = (
        tokio::spawn(load(bc, "small", "k", FAST, Duration::from_secs(10))),
        tokio::spawn(load(qc, "small", "k", quietly, Duration::from_secs(10))),
    );
    let tallies = (
        run.0.await.expect("busy load"),
        run.1.await.expect("quiet load"),
    );
    let elapsed = started.elapsed().as_secs_f64().max(10.0);
    let admitted = tallies.0.ok + tallies.1.ok;
    eprintln!(
        "B={b}, r={r}/s over {elapsed:.1}s: busy {:?}, quiet {:?}: {admitted} admitted, {:.0} % of r·t",
        tallies.0,
        tallies.1,
        admitted as f64 * 100.0 / (r as f64 * elapsed)
    );
    assert!(
        admitted as f64 <= b as f64 + r as f64 * elapsed,
        "over B + r·t: {admitted}"
    );
    (tallies.0, tallies.1, elapsed)
}

/// A small global budget (B = 5, r = 5/s) between a busy region and a
/// quiet one: the quiet one keeps a usable share (before, its part of the
/// split was under a token, sent as DENY_ALL: every request OVER_LIMIT
/// for as long as the busy one was busy), and the two together use most
/// of r·t (a region's share keeps its rate instead of being rounded down
/// to whole tokens a second). And B = 1 (fewer tokens than regions): the
/// token goes to the busy region (before: both were sent half a token,
/// DENY_ALL, and the world admitted nothing).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_small_budget_leaves_a_quiet_region_a_usable_share() {
    let (busy, quiet, secs) = small_budget(5, 5).await;
    // the quiet region's share: a token, refilled at about 0.45/s at the
    // least (its floor of the split); 20 requests, one every 500 ms
    assert!(quiet.ok >= 3, "the quiet region was starved: {quiet:?}");
    let fraction = (busy.ok + quiet.ok) as f64 / (5.0 * secs);
    assert!(fraction >= 0.75, "{:.0} % of r·t", fraction * 100.0);
    let (busy, quiet, secs) = small_budget(1, 1).await;
    let fraction = (busy.ok + quiet.ok) as f64 / secs;
    assert!(fraction >= 0.6, "B = 1: {:.0} % of r·t", fraction * 100.0);
}

/// Something answering as a global tier that grants every bucket it is
/// told of a million tokens a second, for ten years.
#[derive(Clone)]
struct GenerousTier;

type QuotaAnswers = std::pin::Pin<
    Box<dyn futures::Stream<Item = Result<rlqs::RateLimitQuotaResponse, tonic::Status>> + Send>,
>;

mod rlqs {
    pub use envoy_types::pb::envoy::r#type::v3::{
        rate_limit_strategy::Strategy, RateLimitStrategy, TokenBucket,
    };
    pub use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::{
        bucket_action, BucketAction,
    };
    pub use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::{
        RateLimitQuotaService, RateLimitQuotaServiceServer,
    };
    pub use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
        RateLimitQuotaResponse, RateLimitQuotaUsageReports,
    };
    pub use envoy_types::pb::google::protobuf::{Duration, UInt32Value};
}

/// A million a second for ten years, for each bucket reported.
fn generous(reports: rlqs::RateLimitQuotaUsageReports) -> rlqs::RateLimitQuotaResponse {
    use rlqs::*;
    let bucket_action = reports
        .bucket_quota_usages
        .into_iter()
        .map(|u| BucketAction {
            bucket_id: u.bucket_id,
            bucket_action: Some(bucket_action::BucketAction::QuotaAssignmentAction(
                bucket_action::QuotaAssignmentAction {
                    assignment_time_to_live: Some(Duration {
                        seconds: 10 * 365 * 24 * 3600,
                        nanos: 0,
                    }),
                    rate_limit_strategy: Some(RateLimitStrategy {
                        strategy: Some(Strategy::TokenBucket(TokenBucket {
                            max_tokens: 1_000_000,
                            tokens_per_fill: Some(UInt32Value { value: 1_000_000 }),
                            fill_interval: Some(Duration {
                                seconds: 1,
                                nanos: 0,
                            }),
                        })),
                    }),
                },
            )),
        })
        .collect();
    RateLimitQuotaResponse { bucket_action }
}

#[tonic::async_trait]
impl rlqs::RateLimitQuotaService for GenerousTier {
    type StreamRateLimitQuotasStream = QuotaAnswers;

    async fn stream_rate_limit_quotas(
        &self,
        request: tonic::Request<tonic::Streaming<rlqs::RateLimitQuotaUsageReports>>,
    ) -> Result<tonic::Response<QuotaAnswers>, tonic::Status> {
        let answers = futures::stream::unfold(request.into_inner(), |mut inbound| async move {
            let reports = inbound.message().await.ok().flatten()?;
            Some((Ok(generous(reports)), inbound))
        });
        Ok(tonic::Response::new(Box::pin(answers)))
    }
}

/// A region trusts its global tier only so far: told it may spend a
/// million a second for ten years on a rule of B = 30, r = 30/s, it
/// spends at most the rule's own (before: 300 of 300 admitted), and
/// counts the cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_region_cuts_what_a_global_tier_grants_to_its_rule() {
    let rules = rules_dir(
        "domain: world\ndescriptors:\n  - key: strict\n    scope: global\n    failure_mode: closed\n    rate_limit: {unit: second, requests_per_unit: 30, burst: 30}\n",
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let tier = listener.local_addr().expect("addr");
    let (_reporter, health) = tonic_health::server::health_reporter();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(health)
            .add_service(rlqs::RateLimitQuotaServiceServer::new(GenerousTier))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );
    let region = region_here(&rules, tier, "eu", 2).await;
    let mut c = RateLimitServiceClient::connect(format!("http://{}", region.grpc_addr))
        .await
        .expect("connect");
    let call = |c: &mut RateLimitServiceClient<Channel>| {
        let mut c = c.clone();
        async move {
            c.should_rate_limit(request("world", vec![descriptor(&[("strict", "k")])]))
                .await
                .map(|r| r.into_inner().overall_code == Code::Ok as i32)
                .unwrap_or(false)
        }
    };
    // the first request opens the bucket; then wait for the grant
    call(&mut c).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while sample(&region.metrics.render(), "rls_region_assignments_total").unwrap_or(0.0) < 1.0 {
        assert!(Instant::now() < deadline, "no assignment came");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let started = Instant::now();
    let mut admitted = 0;
    for _ in 0..300 {
        admitted += u64::from(call(&mut c).await);
    }
    let secs = started.elapsed().as_secs_f64();
    assert!(
        admitted as f64 <= 30.0 + 30.0 * secs + 1.0,
        "{admitted} of 300 in {secs:.2}s on B = 30, r = 30/s"
    );
    // counted at the next report (every second)
    let cut = |text: &str, part: &str| {
        sample(
            text,
            &format!("rls_region_assignments_clamped_total{{part=\"{part}\"}}"),
        )
        .unwrap_or(0.0)
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let text = region.metrics.render();
        if ["burst", "rate", "ttl"]
            .iter()
            .all(|p| cut(&text, p) >= 1.0)
        {
            break;
        }
        assert!(Instant::now() < deadline, "cuts not counted: {text}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

const SLOW_RULES: &str = r#"
domain: world
descriptors:
  - key: slow
    scope: global
    failure_mode: closed
    rate_limit: {unit: minute, requests_per_unit: 6, burst: 30}
"#;

/// Calls `entries` on `s` `n` times at once: how many were admitted.
async fn admitted_now(s: &tokenbucket_rls::server::RunningServer, n: usize) -> u64 {
    let mut c = RateLimitServiceClient::connect(format!("http://{}", s.grpc_addr))
        .await
        .expect("connect");
    let mut ok = 0;
    for _ in 0..n {
        let r = c
            .should_rate_limit(request("world", vec![descriptor(&[("slow", "k")])]))
            .await;
        ok += u64::from(r.is_ok_and(|r| r.into_inner().overall_code == Code::Ok as i32));
    }
    ok
}

/// A region that restarts: on the memory store its buckets start full
/// again, so it may spend up to its floor (B/N) once more per restart (the
/// README says so); on the Redis store they are where it left them, and
/// a restart adds nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restarted_region_spends_a_fresh_floor_only_on_the_memory_store() {
    let rules = rules_dir(SLOW_RULES);
    // B = 30, 6 a minute, N = 2: a floor of 15
    for redis in [None, Some(RedisServer::standalone())] {
        let tier = tokenbucket_rls::server::start(&serve_args(rules.path().to_path_buf()))
            .await
            .expect("global tier");
        let start = || {
            let mut args = serve_args(rules.path().to_path_buf());
            args.quota_upstream = Some(format!("http://{}", tier.grpc_addr));
            args.region = Some("eu".into());
            args.regions = Some(2);
            if let Some(redis) = &redis {
                args.store = tokenbucket_rls::cli::StoreKind::Redis;
                args.redis_url = Some(redis.url());
            }
            async move { tokenbucket_rls::server::start(&args).await.expect("region") }
        };
        let eu = start().await;
        let before = admitted_now(&eu, 40).await;
        assert_eq!(before, 15, "the floor, B/N");
        eu.shutdown().await.expect("stop");
        let again = start().await;
        let after = admitted_now(&again, 40).await;
        match &redis {
            None => assert!(after <= 15, "at most a fresh floor: {after}"),
            Some(_) => assert!(after <= 1, "nothing new on Redis: {after}"),
        }
        again.shutdown().await.expect("stop");
        tier.shutdown().await.expect("stop");
    }
}

/// A global tier that restarts knows nothing of the shares it gave: until
/// each region's first new assignment (about a second here), a region
/// spends its old share beside the new split. The bound docs/regions.md states for it:
/// at most one more burst B, plus r for that time; measured here.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restarted_global_tier_overlaps_old_shares_by_at_most_one_burst() {
    let rules = rules_dir(RULES);
    let mut args = serve_args(rules.path().to_path_buf());
    args.grpc_addr = std::net::SocketAddr::from(([127, 0, 0, 1], free_port()));
    let tier = tokenbucket_rls::server::start(&args)
        .await
        .expect("global tier");
    let eu = region_here(&rules, args.grpc_addr, "eu", 2).await;
    let us = region_here(&rules, args.grpc_addr, "us", 2).await;
    let client = |s: &tokenbucket_rls::server::RunningServer| {
        RateLimitServiceClient::connect(format!("http://{}", s.grpc_addr))
    };
    let (e, u) = (
        client(&eu).await.expect("connect"),
        client(&us).await.expect("connect"),
    );
    let started = Instant::now();
    let run = (
        tokio::spawn(load(e, "api", "k", FAST, Duration::from_secs(9))),
        tokio::spawn(load(u, "api", "k", FAST, Duration::from_secs(9))),
    );
    tokio::time::sleep(Duration::from_secs(4)).await;
    tier.shutdown().await.expect("stop");
    let tier = tokenbucket_rls::server::start(&args)
        .await
        .expect("global tier again");
    let tallies = [run.0.await.expect("eu"), run.1.await.expect("us")];
    let secs = started.elapsed().as_secs_f64();
    let admitted = total(&tallies);
    eprintln!(
        "a global tier restarted after 4 s of {secs:.1} s: {admitted} admitted, B + r·t = {:.0}",
        B as f64 + R as f64 * secs
    );
    assert!(
        admitted as f64 <= 2.0 * B as f64 + R as f64 * secs,
        "{admitted} over {secs:.1}s: {tallies:?}"
    );
    tier.shutdown().await.expect("stop");
}

//! `rls-bench`: a gRPC load generator for any Envoy rate-limit service
//! (this one, Limitador, envoyproxy/ratelimit).
//!
//! Closed loop: `--connections` × `--concurrency` callers, each sending its
//! next request when the last one is answered. Open loop (`--rate`): requests
//! are due at fixed intervals whatever the service does, and latency counts
//! from when a request was due, so a stalled service shows up as latency
//! instead of being hidden by a slower send rate (coordinated omission).
//! Keys: one hot key, uniform over K keys, or zipf(s) over K keys.
//! `--rlqs`: simulated Envoys on RLQS streams instead ([`rlqs`]).

#[path = "rls-bench/grpc.rs"]
mod grpc;
#[path = "rls-bench/rlqs.rs"]
mod rlqs;

// the allocator the service uses: the generator's own cost per request
// is part of its report
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::{Parser, ValueEnum};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use futures::stream::{FuturesUnordered, StreamExt};
use hdrhistogram::Histogram;

#[derive(Debug, Clone, Copy, PartialEq, ValueEnum)]
enum Distribution {
    /// Every request on one key.
    Hot,
    /// Uniform over --keys keys.
    Uniform,
    /// Zipf over --keys keys with exponent --zipf-s.
    Zipf,
}

#[derive(Debug, Clone, Parser)]
#[command(
    name = "rls-bench",
    version,
    about = "Load generator for Envoy rate-limit services (gRPC ShouldRateLimit)"
)]
struct Args {
    /// The service, e.g. http://127.0.0.1:8081.
    #[arg(long, default_value = "http://127.0.0.1:8081")]
    target: String,
    #[arg(long, default_value = "bench")]
    domain: String,
    /// Descriptor key; its value is the chosen key (`k<N>`).
    #[arg(long, default_value = "key")]
    key: String,
    #[arg(long, value_enum, default_value = "hot")]
    distribution: Distribution,
    /// Distinct values for uniform and zipf.
    #[arg(long, default_value_t = 10_000)]
    keys: u64,
    #[arg(long, default_value_t = 1.0)]
    zipf_s: f64,
    /// Descriptors per request (each with its own key draw).
    #[arg(long, default_value_t = 1)]
    descriptors: usize,
    /// hits_addend of every request (0: unset, which means 1).
    #[arg(long, default_value_t = 0)]
    hits_addend: u32,
    /// Each descriptor also carries this key with a fresh random attempt id
    /// (as Envoy sends x-request-id for a rule with `attempts:`).
    #[arg(long)]
    attempt_key: Option<String>,
    /// With --attempt-key, closed loop: each admitted call is followed by
    /// its done call (the same descriptors and id, and `phase: done`), as
    /// Envoy settles a stream; both calls count as requests.
    #[arg(long, requires = "attempt_key")]
    settle: bool,
    /// Every request also carries a descriptor of this one entry
    /// (`KEY=VALUE`), after the others: a limit that refuses every request
    /// (`requests_per_unit: 0`), to measure refused requests whose other
    /// descriptors were admitted (and are given back).
    #[arg(long, value_parser = parse_entry)]
    extra_descriptor: Option<(String, String)>,
    /// HTTP/2 connections.
    #[arg(long, default_value_t = 8)]
    connections: usize,
    /// Closed loop: requests in flight per connection.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Open loop: requests per second in total (closed loop when absent).
    #[arg(long)]
    rate: Option<u64>,
    /// How long to measure.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// Stop after this many requests instead (whichever comes first).
    #[arg(long)]
    requests: Option<u64>,
    /// Unmeasured warm-up before the run.
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    warmup: Duration,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// Generator threads (0: one per core), each a current-thread runtime
    /// holding its share of the connections (RLQS: the runtime's worker
    /// threads). On a machine shared with the service, fewer generator
    /// threads leave the service more of the cores and fewer preemptions in
    /// its latency.
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// RLQS instead of ShouldRateLimit: `throughput` (simulated Envoys
    /// reporting as fast as the service takes it) or `converge` (time for
    /// shares to follow a shift in demand).
    #[arg(long, value_enum)]
    rlqs: Option<rlqs::Mode>,
    /// RLQS: simulated Envoys (one stream each).
    #[arg(long, default_value_t = 10)]
    streams: usize,
    /// RLQS: buckets per stream (`{<key>: k<i>}`).
    #[arg(long, default_value_t = 10)]
    buckets: usize,
    /// RLQS throughput: each stream reports all its buckets once per this
    /// interval (as Envoy does) instead of as fast as the service takes
    /// them: for the service's memory per (Envoy, bucket) at a real pace.
    #[arg(long, value_parser = humantime::parse_duration)]
    report_every: Option<Duration>,
    /// RLQS throughput: each stream reports buckets of its own
    /// (`{<key>: s<n>-k<i>}`) instead of the same ones as every other
    /// stream: streams x buckets distinct buckets, one Envoy each.
    #[arg(long)]
    distinct_buckets: bool,
    /// RLQS throughput: the service's admin address (`127.0.0.1:8080`), to
    /// count the bucket reports it processed (`rls_quota_reports_total`)
    /// rather than those sent; the run waits until that count stops moving.
    #[arg(long)]
    admin: Option<String>,
}

/// SplitMix64: fast, small, good enough to pick keys.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Chooses key indexes according to the distribution.
struct Keys {
    dist: Distribution,
    count: u64,
    /// Zipf: cumulative probabilities, searched with a uniform draw.
    cdf: Vec<f64>,
}

impl Keys {
    fn new(dist: Distribution, count: u64, s: f64) -> Self {
        let count = count.max(1);
        let cdf = if dist == Distribution::Zipf {
            let weights: Vec<f64> = (1..=count).map(|k| 1.0 / (k as f64).powf(s)).collect();
            let total: f64 = weights.iter().sum();
            let mut acc = 0.0;
            weights
                .iter()
                .map(|w| {
                    acc += w / total;
                    acc
                })
                .collect()
        } else {
            Vec::new()
        };
        Self { dist, count, cdf }
    }

    fn pick(&self, rng: &mut Rng) -> u64 {
        match self.dist {
            Distribution::Hot => 0,
            Distribution::Uniform => rng.next() % self.count,
            Distribution::Zipf => {
                let u = rng.unit();
                self.cdf.partition_point(|&c| c < u).min(self.cdf.len() - 1) as u64
            }
        }
    }
}

#[derive(Default)]
struct Counts {
    ok: AtomicU64,
    over: AtomicU64,
    errors: AtomicU64,
    /// Answers in which some descriptor carried a `current_limit`, i.e. a
    /// rule matched and a bucket decided.
    limited: AtomicU64,
}

/// `KEY=VALUE`, for --extra-descriptor.
fn parse_entry(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .filter(|(k, _)| !k.is_empty())
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("{s:?}: expected KEY=VALUE"))
}

struct Shared {
    args: Args,
    keys: Keys,
    counts: Counts,
    sent: AtomicU64,
}

impl Shared {
    fn request(&self, rng: &mut Rng) -> RateLimitRequest {
        RateLimitRequest {
            domain: self.args.domain.clone(),
            descriptors: (0..self.args.descriptors)
                .map(|_| {
                    let mut entries = vec![Entry {
                        key: self.args.key.clone(),
                        value: format!("k{}", self.keys.pick(rng)),
                    }];
                    if let Some(key) = &self.args.attempt_key {
                        entries.push(Entry {
                            key: key.clone(),
                            value: format!("{:016x}{:016x}", rng.next(), rng.next()),
                        });
                    }
                    RateLimitDescriptor {
                        entries,
                        ..Default::default()
                    }
                })
                .chain(
                    self.args
                        .extra_descriptor
                        .iter()
                        .map(|(key, value)| RateLimitDescriptor {
                            entries: vec![Entry {
                                key: key.clone(),
                                value: value.clone(),
                            }],
                            ..Default::default()
                        }),
                )
                .collect(),
            hits_addend: self.args.hits_addend,
        }
    }

    /// Reserves one request slot; false when --requests is used up.
    fn take(&self) -> bool {
        let n = self.sent.fetch_add(1, Ordering::Relaxed);
        self.args.requests.is_none_or(|max| n < max)
    }

    fn record(
        &self,
        result: &Result<envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse>,
    ) {
        let counter = match result {
            Ok(r) if r.overall_code == Code::OverLimit as i32 => &self.counts.over,
            Ok(_) => &self.counts.ok,
            Err(_) => &self.counts.errors,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        if let Ok(r) = result {
            if r.statuses.iter().any(|s| s.current_limit.is_some()) {
                self.counts.limited.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

fn histogram() -> Histogram<u64> {
    // 1 µs to 60 s, 3 significant digits.
    Histogram::new_with_bounds(1, 60_000_000, 3).expect("valid histogram bounds")
}

/// Generator threads, each running a current-thread runtime. A connection
/// (its HTTP/2 task and every call on it) lives on one of them, so the
/// requests its callers send after a batch of answers leave in one write,
/// and no call hops threads: about 3 µs of the generator's CPU per request
/// on one thread, against 7 µs on a shared multi-thread runtime.
struct Generators {
    handles: Vec<tokio::runtime::Handle>,
    /// Dropped to stop the threads.
    _stop: Vec<tokio::sync::oneshot::Sender<()>>,
}

impl Generators {
    /// `threads` of them (0: one per core).
    fn start(threads: usize) -> Result<Self> {
        let n = match threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        };
        let mut handles = Vec::with_capacity(n);
        let mut stop = Vec::with_capacity(n);
        for i in 0..n {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .context("cannot start a generator runtime")?;
            handles.push(runtime.handle().clone());
            let (tx, rx) = tokio::sync::oneshot::channel::<()>();
            stop.push(tx);
            std::thread::Builder::new()
                .name(format!("rls-bench-{i}"))
                .spawn(move || {
                    let _ = runtime.block_on(rx);
                })
                .context("cannot start a generator thread")?;
        }
        Ok(Self {
            handles,
            _stop: stop,
        })
    }

    /// The runtime of connection `c`.
    fn of(&self, c: usize) -> &tokio::runtime::Handle {
        &self.handles[c % self.handles.len()]
    }

    /// Connection `c`, made on its own generator thread.
    async fn connect(&self, c: usize, target: &str) -> Result<grpc::Client> {
        let target = target.to_string();
        self.of(c)
            .spawn(async move { grpc::Client::connect(&target).await })
            .await
            .context("a generator thread stopped")?
    }
}

/// Waits for every caller and adds up their histograms.
async fn merged(tasks: Vec<tokio::task::JoinHandle<Histogram<u64>>>) -> Histogram<u64> {
    let mut total = histogram();
    for t in tasks {
        if let Ok(h) = t.await {
            let _ = total.add(&h);
        }
    }
    total
}

/// Closed loop: each caller sends when its last request was answered.
async fn closed_loop(
    shared: Arc<Shared>,
    generators: &Generators,
    clients: Vec<grpc::Client>,
    until: Instant,
) -> Histogram<u64> {
    let mut tasks = Vec::new();
    for (c, client) in clients.into_iter().enumerate() {
        for m in 0..shared.args.concurrency {
            let (shared, mut client) = (shared.clone(), client.clone());
            let seed = (c * 1000 + m) as u64 + 1;
            tasks.push(generators.of(c).spawn(async move {
                let mut rng = Rng(seed);
                let mut hist = histogram();
                let mut done_call = None;
                while Instant::now() < until && shared.take() {
                    let req = done_call.take().unwrap_or_else(|| shared.request(&mut rng));
                    let start = Instant::now();
                    let result = client.should_rate_limit(&req).await;
                    let _ = hist.record(start.elapsed().as_micros().max(1) as u64);
                    shared.record(&result);
                    let admitted = matches!(&result, Ok(r) if r.overall_code == Code::Ok as i32);
                    if shared.args.settle && admitted && !is_done_call(&req) {
                        done_call = Some(into_done_call(req));
                    }
                }
                hist
            }));
        }
    }
    merged(tasks).await
}

/// The entry that marks a done call (the service's default `phase_key`).
const PHASE_DONE: (&str, &str) = ("phase", "done");

fn is_done_call(req: &RateLimitRequest) -> bool {
    req.descriptors
        .iter()
        .any(|d| d.entries.iter().any(|e| e.key == PHASE_DONE.0))
}

/// A start's done call: the same descriptors, each marked done.
fn into_done_call(mut req: RateLimitRequest) -> RateLimitRequest {
    for descriptor in &mut req.descriptors {
        descriptor.entries.push(Entry {
            key: PHASE_DONE.0.into(),
            value: PHASE_DONE.1.into(),
        });
    }
    req
}

/// The open loop's pacer sleeps at least this long between batches.
const PACER_TICK: Duration = Duration::from_micros(200);

/// Latencies of one run: from when each request was due (open loop; for the
/// closed loop the same as from its send) and from when it was handed to the
/// client.
struct Latencies {
    from_due: Histogram<u64>,
    from_send: Histogram<u64>,
}

/// Open loop: a pacer thread (not a tokio timer, which wakes at millisecond
/// steps) hands out due times at `rate`, round-robin over the connections;
/// each connection's task sends at once and keeps its calls in flight
/// together. Latency counts from the due time, so neither a stalled service
/// nor a late generator is hidden (coordinated omission); the time from the
/// actual send is kept beside it, to tell the two apart.
async fn open_loop(
    shared: Arc<Shared>,
    generators: &Generators,
    clients: Vec<grpc::Client>,
    rate: u64,
    until: Instant,
) -> Latencies {
    let mut senders = Vec::new();
    let mut tasks = Vec::new();
    for (c, client) in clients.into_iter().enumerate() {
        let shared = shared.clone();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Instant>();
        senders.push(tx);
        tasks.push(generators.of(c).spawn(async move {
            let mut rng = Rng(c as u64 + 7);
            let mut lat = Latencies {
                from_due: histogram(),
                from_send: histogram(),
            };
            let mut in_flight = FuturesUnordered::new();
            let mut receiving = true;
            loop {
                tokio::select! {
                    due = rx.recv(), if receiving => match due {
                        Some(due) => {
                            let req = shared.request(&mut rng);
                            let mut client = client.clone();
                            in_flight.push(async move {
                                let sent = Instant::now();
                                (due, sent, client.should_rate_limit(&req).await)
                            });
                        }
                        None => receiving = false,
                    },
                    Some((due, sent, result)) = in_flight.next(), if !in_flight.is_empty() => {
                        let _ = lat.from_due.record(due.elapsed().as_micros().max(1) as u64);
                        let _ = lat.from_send.record(sent.elapsed().as_micros().max(1) as u64);
                        shared.record(&result);
                    }
                    else => break,
                }
            }
            lat
        }));
    }
    let pacer_shared = shared.clone();
    let pacer = std::thread::spawn(move || {
        let interval = 1.0 / rate.max(1) as f64;
        let start = Instant::now();
        let due = |i: u64| start + Duration::from_secs_f64(i as f64 * interval);
        let mut i = 0u64;
        'run: loop {
            let now = Instant::now();
            while due(i) <= now {
                if due(i) >= until
                    || !pacer_shared.take()
                    || senders[(i % senders.len() as u64) as usize]
                        .send(due(i))
                        .is_err()
                {
                    break 'run;
                }
                i += 1;
            }
            // Wakes at most every PACER_TICK: each wake-up costs the
            // service a share of these two cores; what is due meanwhile
            // goes out together, and counts from its due time.
            std::thread::sleep((due(i) - now).max(PACER_TICK));
        }
        // dropping the senders lets each connection finish its calls in flight
    });
    let mut total = Latencies {
        from_due: histogram(),
        from_send: histogram(),
    };
    for t in tasks {
        if let Ok(lat) = t.await {
            let _ = total.from_due.add(&lat.from_due);
            let _ = total.from_send.add(&lat.from_send);
        }
    }
    let _ = pacer.join();
    total
}

fn main() -> Result<()> {
    let args = Args::parse();
    let mut runtime = if args.threads == 1 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        tokio::runtime::Builder::new_multi_thread()
    };
    if args.threads > 1 {
        runtime.worker_threads(args.threads);
    }
    runtime
        .enable_all()
        .build()
        .context("cannot start the tokio runtime")?
        .block_on(run(args))
}

async fn run(args: Args) -> Result<()> {
    if args.settle && args.rate.is_some() {
        anyhow::bail!("--settle follows each call by its done call: closed loop only (no --rate)");
    }
    if let Some(mode) = args.rlqs {
        return rlqs::run(
            mode,
            rlqs::Settings {
                target: &args.target,
                domain: &args.domain,
                key: &args.key,
                streams: args.streams,
                buckets: args.buckets,
                report_every: args.report_every,
                distinct: args.distinct_buckets,
                admin: args.admin.as_deref(),
                duration: args.duration,
                json: args.json,
            },
        )
        .await;
    }
    let generators = Generators::start(args.threads)?;
    let mut clients = Vec::with_capacity(args.connections.max(1));
    for c in 0..args.connections.max(1) {
        clients.push(generators.connect(c, &args.target).await?);
    }
    let shared = Arc::new(Shared {
        keys: Keys::new(args.distribution, args.keys, args.zipf_s),
        counts: Counts::default(),
        sent: AtomicU64::new(0),
        args,
    });

    if !shared.args.warmup.is_zero() {
        // Same callers and keys, no request cap, nothing recorded.
        let warm = Arc::new(Shared {
            args: Args {
                requests: None,
                ..shared.args.clone()
            },
            keys: Keys::new(
                shared.args.distribution,
                shared.args.keys,
                shared.args.zipf_s,
            ),
            counts: Counts::default(),
            sent: AtomicU64::new(0),
        });
        closed_loop(
            warm,
            &generators,
            clients.clone(),
            Instant::now() + shared.args.warmup,
        )
        .await;
    }

    let cpu_before = own_cpu();
    let started = Instant::now();
    let until = started + shared.args.duration;
    let lat = match shared.args.rate {
        Some(rate) => open_loop(shared.clone(), &generators, clients, rate, until).await,
        None => {
            let hist = closed_loop(shared.clone(), &generators, clients, until).await;
            Latencies {
                from_due: hist.clone(),
                from_send: hist,
            }
        }
    };
    let hist = &lat.from_due;
    let elapsed = started.elapsed().as_secs_f64();
    let (ok, over, errors, limited) = (
        shared.counts.ok.load(Ordering::Relaxed),
        shared.counts.over.load(Ordering::Relaxed),
        shared.counts.errors.load(Ordering::Relaxed),
        shared.counts.limited.load(Ordering::Relaxed),
    );
    let total = ok + over + errors;
    let rps = total as f64 / elapsed;
    // this process's own CPU per request: what loading the service costs
    let client_cpu_us = match (cpu_before, own_cpu()) {
        (Some(b), Some(a)) if total > 0 => Some((a - b).as_secs_f64() * 1e6 / total as f64),
        _ => None,
    };
    let q = |p: f64| hist.value_at_quantile(p);
    let qs = |p: f64| lat.from_send.value_at_quantile(p);
    let a = &shared.args;
    let mode = match a.rate {
        Some(r) => format!("open loop at {r}/s"),
        None => format!("closed loop {}x{}", a.connections, a.concurrency),
    };
    if a.json {
        let json = serde_json::json!({
            "target": a.target, "mode": mode, "distribution": format!("{:?}", a.distribution).to_lowercase(),
            "keys": a.keys, "descriptors": a.descriptors, "seconds": elapsed,
            "requests": total, "ok": ok, "over_limit": over, "errors": errors, "with_limit": limited, "throughput_rps": rps,
            "client_cpu_us": client_cpu_us,
            "latency_us": {"p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "p999": q(0.999), "max": hist.max()},
            "latency_from_send_us": {"p50": qs(0.5), "p90": qs(0.9), "p99": qs(0.99), "p999": qs(0.999), "max": lat.from_send.max()},
        });
        println!("{json}");
    } else {
        let keys = match a.distribution {
            Distribution::Hot => "one hot key".to_string(),
            d => format!("{d:?} over {} keys", a.keys).to_lowercase(),
        };
        println!(
            "{} {mode}, {keys}, {} descriptor(s)/request, {elapsed:.1} s",
            a.target, a.descriptors
        );
        println!(
            "requests {total}: ok {ok}, over_limit {over}, errors {errors}, with a limit {limited}"
        );
        println!("throughput {rps:.0} requests/s");
        if let Some(us) = client_cpu_us {
            println!("rls-bench's own CPU: {us:.1} µs per request");
        }
        println!(
            "latency µs: p50 {} p90 {} p99 {} p999 {} max {}",
            q(0.5),
            q(0.9),
            q(0.99),
            q(0.999),
            hist.max()
        );
        if a.rate.is_some() {
            println!(
                "  from the actual send: p50 {} p90 {} p99 {} p999 {} max {}",
                qs(0.5),
                qs(0.9),
                qs(0.99),
                qs(0.999),
                lat.from_send.max()
            );
        }
    }
    if errors > 0 && errors == total {
        anyhow::bail!("every request failed");
    }
    if let Some(warning) = no_rule_warning(total - errors, limited, a) {
        eprintln!("{warning}");
    }
    Ok(())
}

/// This process's user and system CPU time so far (`/proc/self/stat`);
/// `None` where there is no procfs.
fn own_cpu() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // fields after the command name, which is in parentheses and may hold spaces
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after ')'
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    // clock ticks per second: 100 on Linux for every architecture we build
    Some(Duration::from_millis(ticks * 10))
}

/// A warning when no answer carried a `current_limit`: then no rule matched
/// and the run measured the service's no-rule shortcut, not a bucket.
fn no_rule_warning(answered: u64, limited: u64, args: &Args) -> Option<String> {
    (answered > 0 && limited == 0).then(|| {
        format!(
            "warning: none of the {answered} answers carried a current_limit: either no rule in domain '{}' matches key '{}' with values k0, k1, … (then this measured the no-rule shortcut, not a token bucket), or every answer came from a failure mode",
            args.domain, args.key
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warns_only_when_no_answer_had_a_limit() {
        let args = Args::parse_from(["rls-bench", "--domain", "edge", "--key", "path"]);
        let w = no_rule_warning(100, 0, &args).expect("warning");
        assert!(w.contains("'edge'") && w.contains("'path'"), "{w}");
        assert_eq!(no_rule_warning(100, 1, &args), None);
        assert_eq!(no_rule_warning(0, 0, &args), None, "nothing answered");
    }

    #[test]
    fn zipf_prefers_low_ranks_and_stays_in_range() {
        let keys = Keys::new(Distribution::Zipf, 100, 1.0);
        let mut rng = Rng(1);
        let mut counts = [0u32; 100];
        for _ in 0..100_000 {
            counts[keys.pick(&mut rng) as usize] += 1;
        }
        assert!(counts[0] > counts[1] && counts[1] > counts[10] && counts[10] > counts[99]);
        // rank 1 has 1/H(100) ≈ 19.3 % of the mass
        assert!((17_000..21_500).contains(&counts[0]), "{}", counts[0]);
    }

    #[test]
    fn uniform_and_hot() {
        let mut rng = Rng(3);
        let hot = Keys::new(Distribution::Hot, 100, 1.0);
        assert!((0..1000).all(|_| hot.pick(&mut rng) == 0));
        let uniform = Keys::new(Distribution::Uniform, 10, 1.0);
        let mut seen = [false; 10];
        for _ in 0..1000 {
            seen[uniform.pick(&mut rng) as usize] = true;
        }
        assert!(seen.iter().all(|s| *s));
    }
}

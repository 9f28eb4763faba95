//! The second gRPC face: `envoy.service.rate_limit_quota.v3.RateLimitQuotaService/StreamRateLimitQuotas`
//! (RLQS), served on the same port as `ShouldRateLimit`.
//!
//! **Its own thread.** Every stream's reader, the ticker and the ledger
//! steps run on one thread of their own (`rls-quota`), never on a serving
//! thread: a fleet's reports, however many, queue there and are held back
//! by HTTP/2 flow control, while `ShouldRateLimit` calls on the same
//! connections and threads go on. Only that thread takes the state's lock,
//! and a tick lets reports in between chunks of [`TICK_CHUNK`] buckets.
//!
//! Each Envoy holds one bidirectional stream per domain: it streams usage
//! reports, and the server pushes assignments whenever shares move. The
//! decisions are [`crate::quota::Quotas`]'; this file only carries messages
//! between it and the streams, and re-plans every [`TICK`] so that expired
//! assignments, quiet Envoys and reloads take effect without a report. With
//! a shared ledger (the Redis store), the steps it queues are taken here,
//! concurrently, and their answers handed back.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::RateLimitQuotaService;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use futures::{Stream, StreamExt};
use parking_lot::Mutex;
use tonic::{Request, Response, Status, Streaming};

use super::ledger_watch::LedgerWatch;
use super::mailbox::{Mailbox, Reply};
use crate::clock::{Clock, MonotonicClock};
use crate::instances::Instances;
use crate::quota::ledger::{Member, QuotaLedger};
use crate::quota::{outbox, Outbox, Pending, Quotas, Step, StreamId};
use crate::rules::SharedRules;
use crate::telemetry::tracing::SPAN_TARGET;
use crate::telemetry::Metrics;

/// How often every bucket is re-planned without a report.
pub const TICK: Duration = Duration::from_secs(1);
/// RLQS streams open at once, at most; one more is refused with
/// RESOURCE_EXHAUSTED (`rls_quota_dropped_total{reason="stream_limit"}`).
/// What waits for each is bounded by [`super::mailbox`]: an action past
/// its bounds is dropped (`reason="outbox_full"`): what Envoy holds then
/// expires, and the split counts it as live until it does.
pub const MAX_STREAMS: usize = 50_000;
/// How long [`QuotaHub::farewell`] waits for its messages to be written.
pub const FAREWELL_FLUSH: std::time::Duration = std::time::Duration::from_secs(1);

/// Ledger steps in flight at once (a tick's batch is one step per bucket);
/// answers are handed back in chunks of at most this many, as they come.
/// Few: the steps go over the decisions' own connections, and Redis runs a
/// connection's pipelined calls back to back, so a decision written behind
/// them waits for them all (256 in flight put 2–3 ms into ShouldRateLimit's
/// p99 beside a fleet of 1,000 buckets; 16 take about 0.2 ms of Redis).
pub const LEDGER_CALLS: usize = 16;
/// Buckets a tick looks at before it lets waiting reports in.
pub const TICK_CHUNK: usize = 2048;

/// The gRPC metadata a region's streams carry (see [`crate::quota::upstream`]).
pub use crate::quota::upstream::{REGIONS_HEADER, REGION_HEADER};

/// Who a stream is: an Envoy (its own member of every split), or one
/// instance of a region (all of the region's instances reporting a domain
/// are one member: their reports add up, each is sent the region's share).
#[derive(Debug, Clone)]
enum Caller {
    Envoy,
    Region { name: String, regions: u32 },
}

/// The RLQS state and the open streams' outboxes.
pub struct QuotaHub {
    rules: SharedRules,
    metrics: Arc<Metrics>,
    clock: MonotonicClock,
    quotas: Mutex<Quotas>,
    /// Each open stream's outbox and domain (its metric label, once known).
    streams: Mutex<HashMap<StreamId, (Arc<Mailbox>, String)>>,
    /// Bytes waiting in every stream's outbox.
    outbox_bytes: Arc<std::sync::atomic::AtomicUsize>,
    /// Regions: per (region, domain), the member the split knows and the
    /// streams of the region's instances that report for it.
    regions: Mutex<Regions>,
    next_stream: AtomicU64,
    /// Set at shutdown: every stream's reader stops.
    closing: tokio::sync::watch::Sender<bool>,
    /// The shared ledger, if budgets are split across replicas.
    ledger: Option<Arc<dyn QuotaLedger>>,
    /// This replica's name in the ledger (random at start).
    replica: u32,
    /// Whether buckets are assigned without the ledger now (logs, /readyz).
    ledger_watch: LedgerWatch,
    /// `--instances`: each splits 1/N of every budget (not for regions).
    instances: Instances,
    /// The `rls-quota` thread's runtime, where all RLQS work runs.
    runtime: tokio::runtime::Handle,
}

impl QuotaHub {
    /// For one of `instances` instances serving RLQS (`--instances`), each
    /// splitting its part of every budget; or, with `ledger`, for one of
    /// any number of replicas splitting the whole through it.
    pub fn new(
        rules: SharedRules,
        metrics: Arc<Metrics>,
        instances: impl Into<Instances>,
        ledger: Option<Arc<dyn QuotaLedger>>,
    ) -> anyhow::Result<Arc<Self>> {
        let instances = instances.into();
        let quotas = match ledger {
            Some(_) => Quotas::shared().with_instances(instances.clone()),
            None => Quotas::for_instances(instances.clone()),
        };
        let closing = tokio::sync::watch::channel(false).0;
        let runtime = start_thread(closing.subscribe())?;
        Ok(Arc::new(Self {
            rules,
            metrics,
            clock: MonotonicClock::new(),
            quotas: Mutex::new(quotas),
            streams: Mutex::new(HashMap::new()),
            outbox_bytes: Arc::default(),
            regions: Mutex::new(Regions::default()),
            next_stream: AtomicU64::new(1),
            closing,
            ledger,
            replica: random_replica(),
            ledger_watch: LedgerWatch::default(),
            instances,
            runtime,
        }))
    }

    /// Re-plans every [`TICK`] for as long as the hub lives (a tick whose
    /// ledger steps take longer delays the next), on the RLQS thread.
    pub fn spawn_ticker(self: &Arc<Self>) {
        let weak = Arc::downgrade(self);
        self.runtime.spawn(async move {
            let mut tick = tokio::time::interval(TICK);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(hub) = weak.upgrade() else {
                    return;
                };
                let now = hub.clock.now_micros();
                let rules = hub.rules.load();
                // the due buckets, a chunk at a time: reports waiting for
                // the lock get in between chunks
                let mut pending = Pending::new();
                loop {
                    let started = std::time::Instant::now();
                    let more = hub
                        .quotas
                        .lock()
                        .tick_some(&rules, now, TICK_CHUNK, &mut pending);
                    hub.metrics.quota_busy("tick", started.elapsed());
                    if !more {
                        break;
                    }
                    tokio::task::yield_now().await;
                }
                hub.send(outbox(pending));
                hub.take_steps().await;
                let fractions = hub.quotas.lock().assigned_fractions();
                hub.metrics.quota_shares(&fractions);
            }
        });
    }

    /// Takes the ledger steps queued, concurrently, and sends what their
    /// answers call for as they come back (a batch's slowest step delays
    /// no other's answer). A step that fails sends the bucket's Envoys a
    /// share that keeps the fleet within bounds ([`Quotas::refused`]):
    /// never nothing, which would let their assignments lapse and Envoy
    /// fall back to its `no_assignment_behavior`.
    async fn take_steps(&self) {
        let Some(ledger) = &self.ledger else {
            return;
        };
        let steps: Vec<Step> = self.quotas.lock().take_steps();
        if steps.is_empty() {
            return;
        }
        let member = Member {
            replica: self.replica,
        };
        let clock = &self.clock;
        let calls = futures::stream::iter(steps).map(|step| async move {
            let ttl_ms = i64::try_from(step.ttl_micros / 1000).unwrap_or(i64::MAX);
            let held = step.held_at(clock.now_micros());
            let answer = ledger
                .step(&step.key, member, step.demand, held, step.budget, ttl_ms)
                .await;
            (step, answer)
        });
        let mut ready = calls
            .buffer_unordered(LEDGER_CALLS)
            .ready_chunks(LEDGER_CALLS);
        while let Some(chunk) = ready.next().await {
            let mut answers = Vec::with_capacity(chunk.len());
            let mut failed = Vec::new();
            for (step, answer) in chunk {
                match answer {
                    Ok(shared) => {
                        // read as untrusted: anyone who reaches the Redis
                        // can write the ledger's hash
                        let ttl_ms = i64::try_from(step.ttl_micros / 1000).unwrap_or(i64::MAX);
                        let kept = shared.within(step.budget, ttl_ms);
                        if kept != shared {
                            self.metrics.untrusted_refused("ledger", "out_of_bounds");
                        }
                        answers.push((step, kept));
                    }
                    Err(e) => {
                        self.metrics.store_error(e.kind());
                        tracing::debug!(domain = %crate::shown::escaped(&step.key.domain), error = %e, "RLQS ledger step failed");
                        self.ledger_watch.failed(&e.to_string());
                        failed.push(step);
                    }
                }
            }
            let now = self.clock.now_micros();
            let (answered, unanswered, without) = {
                let mut quotas = self.quotas.lock();
                let answered = quotas.granted(answers, now);
                let unanswered = quotas.refused(failed, now);
                (answered, unanswered, quotas.without_ledger())
            };
            self.send(answered);
            for (stream, response) in &unanswered {
                let domain = self.domain_of(*stream);
                self.metrics
                    .quota_without_ledger(&domain, response.bucket_action.len() as u64);
            }
            self.send(unanswered);
            self.metrics.quota_buckets_without_ledger(without);
            self.ledger_watch.now_without(without, now).log();
        }
    }

    /// What this replica assigns without the shared ledger now, for
    /// `/readyz` (`None`: nothing, or no ledger).
    pub fn ledger_trouble(&self) -> Option<String> {
        self.ledger_watch.describe(self.clock.now_micros())
    }

    /// The metric label of `stream`'s domain ("" before its first report;
    /// a region's member is not a stream).
    fn domain_of(&self, stream: StreamId) -> String {
        self.streams
            .lock()
            .get(&stream)
            .map(|(_, domain)| domain.clone())
            .unwrap_or_default()
    }

    /// A new stream's outbox (on the serving thread: no more than that);
    /// refused past [`MAX_STREAMS`].
    fn open(&self) -> Result<(StreamId, Arc<Mailbox>), Status> {
        let id = self.next_stream.fetch_add(1, Ordering::Relaxed);
        let mailbox = Arc::new(Mailbox::new(self.outbox_bytes.clone()));
        let open = {
            let mut streams = self.streams.lock();
            if streams.len() >= MAX_STREAMS {
                drop(streams);
                self.metrics.quota_dropped("stream_limit", 1);
                return Err(Status::resource_exhausted(format!(
                    "this instance holds {MAX_STREAMS} RLQS streams already; try another"
                )));
            }
            streams.insert(id, (mailbox.clone(), String::new()));
            streams.len()
        };
        self.metrics.quota_streams(open);
        Ok((id, mailbox))
    }

    /// Queues `response`'s actions in `mailbox`, counting what was queued
    /// for `domain` and what was dropped.
    fn put(&self, mailbox: &Mailbox, domain: &str, response: RateLimitQuotaResponse) {
        let put = mailbox.put(response.bucket_action, self.clock.now_micros());
        self.metrics.quota_assignments(domain, put.queued);
        self.metrics
            .quota_dropped("outbox_full", put.dropped as u64);
        self.metrics
            .quota_outbox_bytes(self.outbox_bytes.load(Ordering::Relaxed));
    }

    /// The member of the split a stream reports as: itself for an Envoy;
    /// for a region's instance, the region's member for the domain of its
    /// first report (made when the region's first instance reports it).
    fn member_of(
        &self,
        stream: StreamId,
        caller: &Caller,
        domain: &str,
    ) -> Result<StreamId, Status> {
        let Caller::Region { name, regions } = caller else {
            return Ok(stream);
        };
        if self.instances.get() > 1 {
            self.metrics.region_refused("instances");
            return Err(Status::failed_precondition(
                "this global tier splits each budget with other instances (--instances above 1); regions need one global-tier instance (docs/regions.md)",
            ));
        }
        let mut all = self.regions.lock();
        match all.count {
            Some(n) if n != *regions => {
                self.metrics.region_refused("count");
                return Err(Status::failed_precondition(format!(
                    "region {name} says --regions {regions}, but the regions already reporting here said {n}; every region must be started with the same --regions"
                )));
            }
            _ => all.count = Some(*regions),
        }
        let key = (name.clone(), domain.to_owned());
        let member = match all.members.get(&key) {
            Some(member) => *member,
            None => {
                let member = self.next_stream.fetch_add(1, Ordering::Relaxed);
                self.quotas.lock().add_region_stream(member, *regions);
                all.members.insert(key.clone(), member);
                member
            }
        };
        all.streams_of.entry(member).or_default().push(stream);
        all.of_stream.insert(stream, key);
        Ok(member)
    }

    async fn report(
        &self,
        stream: StreamId,
        member: StreamId,
        reports: &RateLimitQuotaUsageReports,
    ) -> Result<(), Status> {
        let out = self.report_now(stream, member, reports)?;
        self.deliver(out, stream, member).await;
        self.take_steps().await;
        Ok(())
    }

    fn report_now(
        &self,
        stream: StreamId,
        id: StreamId,
        reports: &RateLimitQuotaUsageReports,
    ) -> Result<Outbox, Status> {
        // one span per report message (exported only with --otlp-endpoint)
        let _span = tracing::info_span!(
            target: SPAN_TARGET,
            "RLQS report",
            stream = id,
            domain = %reports.domain,
            buckets = reports.bucket_quota_usages.len(),
        )
        .entered();
        let rules = self.rules.load();
        let (out, (invalid, over_limit)) = {
            let started = std::time::Instant::now();
            let mut quotas = self.quotas.lock();
            let out = quotas.report_part(
                id,
                stream,
                &reports.domain,
                &reports.bucket_quota_usages,
                &rules,
                self.clock.now_micros(),
            );
            let dropped = quotas.take_dropped();
            drop(quotas);
            self.metrics.quota_busy("report", started.elapsed());
            (out, dropped)
        };
        self.metrics.quota_dropped("invalid", invalid);
        self.metrics.quota_dropped("bucket_limit", over_limit);
        if over_limit > 0 {
            tracing::warn!(
                stream = id,
                buckets = over_limit,
                "RLQS buckets over the limit of one stream or the instance not taken"
            );
        }
        let out = out.map_err(Status::invalid_argument)?;
        let domain = {
            let mut streams = self.streams.lock();
            match streams.get_mut(&stream) {
                Some((_, d)) if d.is_empty() => {
                    *d = self.metrics.quota_domain_label(&rules, &reports.domain);
                    d.clone()
                }
                Some((_, d)) => d.clone(),
                None => String::new(),
            }
        };
        self.metrics
            .quota_reports(&domain, reports.bucket_quota_usages.len());
        Ok(out)
    }

    /// Sends `out`; what goes to `member` (the reporter's member) waits
    /// for room in the `reporter`'s outbox (its next report is read only
    /// then: HTTP/2 flow control holds a client that does not read), what
    /// goes to others (a region's other instances too) is dropped when
    /// theirs is full.
    async fn deliver(&self, out: Outbox, reporter: StreamId, member: StreamId) {
        let (own, others): (Outbox, Outbox) = out.into_iter().partition(|(s, _)| *s == member);
        self.send(others);
        if own.is_empty() {
            return;
        }
        let siblings: Vec<StreamId> = self
            .regions
            .lock()
            .streams_of
            .get(&member)
            .map(|s| s.iter().copied().filter(|s| *s != reporter).collect())
            .unwrap_or_default();
        if !siblings.is_empty() {
            let copies = own
                .iter()
                .flat_map(|(_, r)| siblings.iter().map(|s| (*s, r.clone())))
                .collect();
            self.send_to_streams(copies);
        }
        let Some((mailbox, domain)) = self.streams.lock().get(&reporter).cloned() else {
            return;
        };
        for (_, response) in own {
            self.put(&mailbox, &domain, response);
        }
        mailbox.wait_for_room().await;
    }

    async fn close(&self, stream: StreamId) {
        if let Some((mailbox, _)) = self.streams.lock().remove(&stream) {
            mailbox.close();
        }
        self.metrics
            .quota_outbox_bytes(self.outbox_bytes.load(Ordering::Relaxed));
        self.metrics.quota_streams(self.streams.lock().len());
        // a region's instance: its member goes when its last instance does
        let member = {
            let mut all = self.regions.lock();
            match all.of_stream.remove(&stream) {
                None => Some(stream),
                Some(key) => {
                    let Some(member) = all.members.get(&key).copied() else {
                        return;
                    };
                    let streams = all.streams_of.entry(member).or_default();
                    streams.retain(|s| *s != stream);
                    let last = streams.is_empty();
                    if last {
                        all.members.remove(&key);
                        all.streams_of.remove(&member);
                    }
                    if all.of_stream.is_empty() {
                        // no region reports now: the next may count anew
                        all.count = None;
                    }
                    last.then_some(member)
                }
            }
        };
        let Some(member) = member else {
            return;
        };
        let out = self
            .quotas
            .lock()
            .close(member, &self.rules.load(), self.clock.now_micros());
        self.send(out);
        self.take_steps().await;
    }

    /// Sends `out`, addressed to members: a region's member's messages go
    /// to each of its instances' streams.
    fn send(&self, out: Outbox) {
        if out.is_empty() {
            return;
        }
        let to_streams = {
            let regions = self.regions.lock();
            if regions.streams_of.is_empty() {
                out
            } else {
                out.into_iter()
                    .flat_map(|(id, r)| match regions.streams_of.get(&id) {
                        None => vec![(id, r)],
                        Some(streams) => streams.iter().map(|s| (*s, r.clone())).collect(),
                    })
                    .collect()
            }
        };
        self.send_to_streams(to_streams);
    }

    fn send_to_streams(&self, out: Outbox) {
        let streams = self.streams.lock();
        for (id, response) in out {
            tracing::debug!(stream = id, ?response, "RLQS assignment");
            if let Some((mailbox, domain)) = streams.get(&id) {
                self.put(mailbox, domain, response);
            }
        }
    }

    /// The shutdown's last word to every stream before it ends (see
    /// [`Quotas::farewell`]): what each Envoy holds is sent again to live
    /// until it has reconnected to another replica (reserved that long in
    /// the shared ledger first), and the outboxes are given up to
    /// [`FAREWELL_FLUSH`] to reach the Envoys.
    pub async fn farewell(&self) {
        let now = self.clock.now_micros();
        let rules = self.rules.load();
        let out = self.quotas.lock().farewell(&rules, now);
        self.send(out);
        self.take_steps().await;
        let flushed = std::time::Instant::now() + FAREWELL_FLUSH;
        while self.outbox_bytes() > 0 && std::time::Instant::now() < flushed {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }

    /// Ends every stream (the server is shutting down): each Envoy sees its
    /// stream close and reconnects to another instance.
    pub fn close_all(&self) {
        self.closing.send_replace(true);
        for (_, (mailbox, _)) in self.streams.lock().drain() {
            mailbox.close();
        }
    }

    /// Bytes waiting in every stream's outbox.
    pub fn outbox_bytes(&self) -> usize {
        self.outbox_bytes.load(Ordering::Relaxed)
    }

    /// Streams open now.
    pub fn streams(&self) -> usize {
        self.streams.lock().len()
    }

    /// What the admin page shows of the RLQS face (`/v1/rlqs`).
    pub fn snapshot(&self) -> QuotaSnapshot {
        let mut by_domain: std::collections::BTreeMap<String, usize> = Default::default();
        for (_, domain) in self.streams.lock().values() {
            *by_domain.entry(domain.clone()).or_default() += 1;
        }
        let (buckets, pairs, held) = {
            let quotas = self.quotas.lock();
            (quotas.buckets(), quotas.pairs(), quotas.held())
        };
        QuotaSnapshot {
            streams: by_domain.values().sum(),
            streams_by_domain: by_domain.into_iter().collect(),
            buckets,
            pairs,
            held,
            outbox_bytes: self.outbox_bytes(),
            ledger: self.ledger.is_some(),
            ledger_trouble: self.ledger_trouble(),
        }
    }

    /// On the global tier: the regions' `--regions` (once one reported),
    /// and the regions whose instances report here, by name (`/v1/regions`).
    pub fn regions_reporting(&self) -> (Option<u32>, Vec<String>) {
        let regions = self.regions.lock();
        let names: std::collections::BTreeSet<&String> =
            regions.members.keys().map(|(region, _)| region).collect();
        (regions.count, names.into_iter().cloned().collect())
    }
}

/// The RLQS face at a moment ([`QuotaHub::snapshot`]).
#[derive(Debug, Clone)]
pub struct QuotaSnapshot {
    /// Streams open (an Envoy each, or a region's instance).
    pub streams: usize,
    /// Streams per domain, by domain (a stream's domain is known from its
    /// first report; `""` before).
    pub streams_by_domain: Vec<(String, usize)>,
    /// Buckets reported or assigned.
    pub buckets: usize,
    /// (stream, bucket) pairs held.
    pub pairs: usize,
    /// Buckets that only hold what departed Envoys were sent.
    pub held: usize,
    /// Bytes waiting in the streams' outboxes.
    pub outbox_bytes: usize,
    /// Whether budgets are split through the shared ledger.
    pub ledger: bool,
    /// Why the ledger is not answering, if it is not.
    pub ledger_trouble: Option<String>,
}

/// The regions reporting here.
#[derive(Debug, Default)]
struct Regions {
    /// `--regions` of the first region that reported; others must agree.
    /// Forgotten when no region stream is open.
    count: Option<u32>,
    /// Per (region, domain): its member of the split.
    members: HashMap<(String, String), StreamId>,
    /// Each region instance's stream: its (region, domain).
    of_stream: HashMap<StreamId, (String, String)>,
    /// Each region member's instances' streams.
    streams_of: HashMap<StreamId, Vec<StreamId>>,
}

/// Who opened the stream, from its metadata; a region that names itself
/// without a valid count is refused.
fn caller_of(metadata: &tonic::metadata::MetadataMap) -> Result<Caller, Status> {
    let Some(name) = metadata.get(REGION_HEADER) else {
        return Ok(Caller::Envoy);
    };
    let name = name
        .to_str()
        .ok()
        .filter(|n| !n.is_empty())
        .ok_or_else(|| Status::invalid_argument(format!("{REGION_HEADER} must be a region name")))?
        .to_owned();
    let regions = metadata
        .get(REGIONS_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u32>().ok())
        .filter(|n| *n >= 1)
        .ok_or_else(|| {
            Status::invalid_argument(format!(
                "region {name}: {REGIONS_HEADER} must be the number of regions (1 or more)"
            ))
        })?;
    Ok(Caller::Region { name, regions })
}

/// Starts the `rls-quota` thread: a runtime of its own that runs until
/// `closing` says so (or its sender is gone), then drops what is left.
fn start_thread(
    mut closing: tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<tokio::runtime::Handle> {
    use anyhow::Context;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("rls-quota".into())
        .spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(runtime) => runtime,
                Err(e) => {
                    let _ = tx.send(Err(e));
                    return;
                }
            };
            let _ = tx.send(Ok(runtime.handle().clone()));
            runtime.block_on(async move {
                let _ = closing.wait_for(|c| *c).await;
            });
        })
        .context("cannot start the RLQS thread")?;
    rx.recv()
        .context("the RLQS thread ended at start")?
        .context("cannot start the RLQS thread's runtime")
}

/// A replica's name in the shared ledger: random, so that replicas (and a
/// restarted one) never share members.
fn random_replica() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish() as u32
}

/// A stream's outbox, closed when the response stream that writes it is
/// dropped.
struct ClosesOnDrop(Arc<Mailbox>);

impl Drop for ClosesOnDrop {
    fn drop(&mut self) {
        self.0.close();
    }
}

/// The gRPC service.
pub struct RateLimitQuotaGrpc {
    hub: Arc<QuotaHub>,
    /// Clients show certificates (`--tls-client-ca`): a region's must name
    /// it ([`crate::tls::names_region`]).
    regions_by_certificate: bool,
}

impl RateLimitQuotaGrpc {
    pub fn new(hub: Arc<QuotaHub>) -> Self {
        Self {
            hub,
            regions_by_certificate: false,
        }
    }

    /// Takes a region's stream only from a client whose certificate names
    /// that region (on a port that requires client certificates).
    pub fn with_region_certificates(mut self, required: bool) -> Self {
        self.regions_by_certificate = required;
        self
    }

    /// Refuses a region that its client certificate does not name.
    fn check_region<T>(&self, caller: &Caller, request: &Request<T>) -> Result<(), Status> {
        let Caller::Region { name, .. } = caller else {
            return Ok(());
        };
        if !self.regions_by_certificate {
            return Ok(());
        }
        let named = request
            .peer_certs()
            .is_some_and(|chain| crate::tls::names_region(&chain, name));
        if named {
            return Ok(());
        }
        self.hub.metrics.region_refused("certificate");
        tracing::warn!(region = %name, peer = ?request.remote_addr(), "region stream refused: its client certificate does not name the region");
        Err(Status::permission_denied(format!(
            "region {name}: the client certificate does not name this region (it needs a DNS subject alternative name {name}.regions.<domain>)"
        )))
    }
}

#[tonic::async_trait]
impl RateLimitQuotaService for RateLimitQuotaGrpc {
    type StreamRateLimitQuotasStream = Pin<Box<dyn Stream<Item = Reply> + Send>>;

    async fn stream_rate_limit_quotas(
        &self,
        request: Request<Streaming<RateLimitQuotaUsageReports>>,
    ) -> Result<Response<Self::StreamRateLimitQuotasStream>, Status> {
        let caller = caller_of(request.metadata())?;
        self.check_region(&caller, &request)?;
        let mut inbound = request.into_inner();
        let (id, outbound) = self.hub.open()?;
        let hub = self.hub.clone();
        let mut closing = hub.closing.subscribe();
        // read, decoded and handled on the RLQS thread, not this one
        self.hub.runtime.spawn(async move {
            // the member it reports as, known at its first report
            let mut member: Option<StreamId> = None;
            loop {
                let next = tokio::select! {
                    next = inbound.message() => next,
                    // shutting down: dropping the request ends the call
                    _ = closing.wait_for(|c| *c) => break,
                };
                match next {
                    Ok(Some(reports)) => {
                        let m = match member {
                            Some(m) => Ok(m),
                            None => hub.member_of(id, &caller, &reports.domain),
                        };
                        let result = match m {
                            Ok(m) => {
                                member = Some(m);
                                hub.report(id, m, &reports).await
                            }
                            Err(status) => Err(status),
                        };
                        if let Err(status) = result {
                            tracing::debug!(stream = id, %status, "RLQS stream refused");
                            if let Some((mailbox, _)) = hub.streams.lock().get(&id) {
                                mailbox.fail(status);
                            }
                            break;
                        }
                    }
                    Ok(None) => break,
                    Err(status) => {
                        tracing::debug!(stream = id, %status, "RLQS stream ended");
                        break;
                    }
                }
            }
            hub.close(id).await;
        });
        let hub = self.hub.clone();
        // dropped with the response stream (the client went): the outbox
        // closes, and a reader waiting for room in it moves on to see the end
        let writer = ClosesOnDrop(outbound);
        let replies = futures::stream::unfold((writer, hub), |(writer, hub)| async move {
            let now = || hub.clock.now_micros();
            let expired = |n: usize| hub.metrics.quota_dropped("expired_waiting", n as u64);
            let next = writer.0.next(now, expired).await;
            next.map(|reply| (reply, (writer, hub)))
        });
        Ok(Response::new(Box::pin(replies)))
    }
}

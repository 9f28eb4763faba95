//! One request, one decision when something fails half-way (issue 67): a
//! request answered with an error, or given up by its caller, holds
//! nothing, against a store that fails, stalls or is not acknowledged for
//! the descriptors named so (the Redis store's cases are in
//! tests/give_back.rs).

use std::time::{Duration, Instant};

use super::give_back::{own, Descriptor};
use super::*;
use crate::attempt::{AttemptCall, SlotOutcome};

const RULES: &str = r#"
domain: h
descriptors:
  - key: budget
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: reserving
    overdraft: true
    rate_limit: {unit: minute, requests_per_unit: 1000}
    attempts: {key: request_id, ttl: 5m, reserve: 100}
  - key: streams
    concurrency: 2
    attempts: {key: request_id, ttl: 10m}
  - key: x_broken_shard
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: slow
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: slow_reserving
    overdraft: true
    rate_limit: {unit: minute, requests_per_unit: 1000}
    attempts: {key: request_id, ttl: 5m, reserve: 100}
  - key: unacked
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: unacked_open
    failure_mode: open
    rate_limit: {unit: minute, requests_per_unit: 10}
"#;

/// How long a `slow` descriptor's call takes (a paused shard).
const SLOW: Duration = Duration::from_millis(400);

/// The memory store, with the fates of a Redis Cluster's shards by the
/// descriptor's tag: `broken` fails (a dead shard), `slow` is decided
/// after [`SLOW`] (a paused one: the decision happens when it wakes),
/// `unacked` is decided and then answered `not_replicated`. Its calls
/// wait, so that a request of it can be detached.
struct Shards {
    inner: MemoryStore<ManualClock>,
}

impl Shards {
    /// What happens before the call is decided.
    async fn before(&self, descriptor: &DescriptorBuckets) -> Result<(), StoreError> {
        let has = |w: &[u8]| descriptor.tag.windows(w.len()).any(|x| x == w);
        if has(b"broken") {
            return Err(StoreError::Connection("the shard is gone".into()));
        }
        if has(b"slow") {
            tokio::time::sleep(SLOW).await;
        }
        Ok(())
    }

    /// Whether an admission of `descriptor` goes unacknowledged.
    fn unacked(descriptor: &DescriptorBuckets) -> bool {
        descriptor.tag.windows(7).any(|x| x == b"unacked")
    }
}

#[async_trait]
impl Store for Shards {
    async fn decide(
        &self,
        d: &DescriptorBuckets,
        cost: Cost,
    ) -> Result<Vec<BucketOutcome>, StoreError> {
        self.before(d).await?;
        let outcomes = self.inner.decide(d, cost).await?;
        let spends = matches!(cost, Cost::Spend(_));
        if spends && Self::unacked(d) && outcomes.iter().all(|o| o.admitted) {
            return Err(StoreError::NotReplicated("0 of 1 replicas".into()));
        }
        Ok(outcomes)
    }
    async fn decide_attempt(
        &self,
        d: &DescriptorBuckets,
        cost: Cost,
        call: &AttemptCall,
        patience: Option<Duration>,
    ) -> Result<AttemptOutcome, StoreError> {
        self.before(d).await?;
        self.inner.decide_attempt(d, cost, call, patience).await
    }
    async fn decide_slot(
        &self,
        d: &DescriptorBuckets,
        max: u64,
        call: &AttemptCall,
        rule: RuleId,
        patience: Option<Duration>,
    ) -> Result<SlotOutcome, StoreError> {
        self.before(d).await?;
        self.inner.decide_slot(d, max, call, rule, patience).await
    }
    fn name(&self) -> &'static str {
        "shards"
    }
}

fn limiter() -> Arc<Limiter> {
    let inner = MemoryStore::new(ManualClock::new(1_000_000)).with_attempts(1000, None);
    Arc::new(Limiter::new(
        Arc::new(Shards { inner }),
        FailureMode::Closed,
        1,
        Arc::default(),
    ))
}

fn rules() -> Arc<RuleSet> {
    Arc::new(
        load_sources(
            vec![(PathBuf::from("h.yaml"), RULES.to_string())],
            LoadOptions::default(),
        )
        .expect("valid rules"),
    )
}

/// Decides `descriptors` as the service does ([`Limiter::decide_request`]),
/// the store's calls cut off after `budget`.
async fn request(
    l: &Arc<Limiter>,
    r: &Arc<RuleSet>,
    descriptors: &[Descriptor],
    budget: Option<Duration>,
) -> Result<Vec<Decision>, Unavailable> {
    let inputs: Vec<_> = descriptors
        .iter()
        .map(|(e, c)| DescriptorInput {
            entries: e,
            cost: *c,
            limit_override: None,
            own_hits_addend: true,
        })
        .collect();
    l.decide_request(r, "h", &inputs, budget, None).await
}

/// What `entries` has left, by a check (which takes nothing).
async fn left(l: &Arc<Limiter>, r: &Arc<RuleSet>, entries: &[(&'static str, &'static str)]) -> u64 {
    let d = request(l, r, &[own(entries, Cost::Check)], None).await;
    d.expect("checked")[0].remaining
}

/// `rls_given_back_total` for `reason` and `result`, summed over rules.
fn counted(l: &Limiter, reason: &str, result: &str) -> u64 {
    let (reason, result) = (
        format!("reason=\"{reason}\""),
        format!("result=\"{result}\""),
    );
    super::give_back::counted(l, &[&reason, &result])
}

/// Waits (bounded) until `n` give-backs for `reason` came back, and
/// checks that no more did.
async fn given_back(l: &Limiter, reason: &str, n: u64) {
    let until = Instant::now() + Duration::from_secs(10);
    while counted(l, reason, "ok") < n && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(counted(l, reason, "ok"), n, "given back for {reason}");
}

/// Starts attempts `ids` on `streams=u` alone: whether each got a slot.
async fn slots_taken(l: &Arc<Limiter>, r: &Arc<RuleSet>, ids: &[&'static str]) -> Vec<bool> {
    let mut taken = Vec::new();
    for id in ids {
        let d = request(
            l,
            r,
            &[own(&[("streams", "u"), ("request_id", id)], Cost::Spend(1))],
            None,
        )
        .await;
        taken.push(d.expect("decided")[0].verdict == Verdict::Ok);
    }
    taken
}

#[tokio::test]
async fn an_error_gives_back_what_the_other_descriptors_took() {
    let (l, r) = (limiter(), rules());
    for _ in 0..4 {
        let d = request(
            &l,
            &r,
            &[
                own(&[("budget", "a")], Cost::Spend(3)),
                own(&[("x_broken_shard", "a")], Cost::Spend(1)),
            ],
            None,
        )
        .await;
        assert!(d.is_err(), "a closed rule's failure answers the request");
    }
    given_back(&l, "error", 4).await;
    assert_eq!(left(&l, &r, &[("budget", "a")]).await, 10);
    assert_eq!(
        counted(&l, "error", "failed") + counted(&l, "error", "unanswered"),
        0
    );
}

#[tokio::test]
async fn an_error_in_turn_withdraws_the_slot_and_the_reservation_before_it() {
    let (l, r) = (limiter(), rules());
    let d = request(
        &l,
        &r,
        &[
            own(&[("streams", "u"), ("request_id", "r1")], Cost::Spend(1)),
            own(&[("reserving", "u"), ("request_id", "r1")], Cost::Check),
            own(&[("x_broken_shard", "u")], Cost::Spend(1)),
        ],
        None,
    )
    .await;
    assert!(d.is_err());
    given_back(&l, "error", 2).await;
    assert_eq!(left(&l, &r, &[("reserving", "u")]).await, 1000);
    assert_eq!(
        slots_taken(&l, &r, &["a", "b", "c"]).await,
        [true, true, false]
    );
    // withdrawn, not settled: the request may have run (Envoy's failure
    // mode), and its done call is charged in full
    let done = own(
        &[("reserving", "u"), ("request_id", "r1"), ("phase", "done")],
        Cost::Spend(100),
    );
    request(&l, &r, &[done], None).await.expect("charged");
    assert_eq!(left(&l, &r, &[("reserving", "u")]).await, 900);
}

#[tokio::test]
async fn an_admission_its_replicas_did_not_acknowledge_is_given_back() {
    let (l, r) = (limiter(), rules());
    for _ in 0..3 {
        let alone = request(&l, &r, &[own(&[("unacked", "a")], Cost::Spend(2))], None).await;
        assert!(alone.is_err(), "closed: an error");
        let open = request(
            &l,
            &r,
            &[own(&[("unacked_open", "a")], Cost::Spend(2))],
            None,
        )
        .await;
        assert_eq!(open.expect("open")[0].verdict, Verdict::FailedOpen);
    }
    given_back(&l, "error", 6).await;
    assert_eq!(left(&l, &r, &[("unacked", "a")]).await, 10);
    assert_eq!(left(&l, &r, &[("unacked_open", "a")]).await, 10);
}

#[tokio::test]
async fn a_caller_that_gives_up_holds_nothing() {
    let (l, r) = (limiter(), rules());
    let chat = [
        own(&[("streams", "u"), ("request_id", "r2")], Cost::Spend(1)),
        own(
            &[("slow_reserving", "u"), ("request_id", "r2")],
            Cost::Check,
        ),
    ];
    // Envoy resets the call long before the slow shard answers
    let cut = tokio::time::timeout(Duration::from_millis(50), request(&l, &r, &chat, None)).await;
    assert!(cut.is_err(), "the caller gave up");
    given_back(&l, "late", 2).await;
    assert_eq!(
        slots_taken(&l, &r, &["a", "b", "c"]).await,
        [true, true, false]
    );
    assert_eq!(left(&l, &r, &[("slow_reserving", "u")]).await, 1000);
}

#[tokio::test]
async fn a_call_cut_off_at_its_budget_is_given_back_when_it_answers() {
    let (l, r) = (limiter(), rules());
    let d = request(
        &l,
        &r,
        &[
            own(&[("budget", "b")], Cost::Spend(1)),
            own(&[("slow", "b")], Cost::Spend(2)),
        ],
        Some(Duration::from_millis(100)),
    )
    .await;
    assert!(d.is_err(), "the slow shard outran the budget: closed");
    given_back(&l, "error", 1).await;
    // the slow shard decided when it woke: its answer, late, is given back
    given_back(&l, "late", 1).await;
    assert_eq!(left(&l, &r, &[("budget", "b")]).await, 10);
    assert_eq!(left(&l, &r, &[("slow", "b")]).await, 10);
}

#[tokio::test]
async fn a_turn_that_outruns_its_budget_holds_nothing() {
    let (l, r) = (limiter(), rules());
    let chat = [
        own(&[("streams", "u"), ("request_id", "r3")], Cost::Spend(1)),
        own(
            &[("slow_reserving", "u"), ("request_id", "r3")],
            Cost::Check,
        ),
        own(&[("budget", "u")], Cost::Spend(1)),
    ];
    let d = request(&l, &r, &chat, Some(Duration::from_millis(100))).await;
    assert!(d.is_err(), "the reservation's shard outran the budget");
    // (in turn: the slot, then by key, the shorter first) the slot and the plain budget
    // before it given back at once; the reservation when it ran
    given_back(&l, "error", 2).await;
    given_back(&l, "late", 1).await;
    assert_eq!(
        slots_taken(&l, &r, &["a", "b", "c"]).await,
        [true, true, false]
    );
    assert_eq!(left(&l, &r, &[("slow_reserving", "u")]).await, 1000);
    assert_eq!(left(&l, &r, &[("budget", "u")]).await, 10);
}

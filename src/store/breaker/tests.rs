//! The breaker's state machine on its own, and per-node breakers in front
//! of a fake store of two nodes whose health the tests switch.

use std::sync::atomic::AtomicUsize;

use super::*;

#[test]
fn connection_failures_open_after_three_in_a_row() {
    let mut b = NodeBreaker::default();
    assert_eq!(b.record(CallOutcome::Connection), (Change::None, false));
    assert_eq!(b.record(CallOutcome::Answered), (Change::None, false));
    assert_eq!(b.record(CallOutcome::Connection), (Change::None, false));
    assert_eq!(b.record(CallOutcome::Connection), (Change::None, false));
    assert!(!b.is_open(), "an answer in between resets the count");
    assert_eq!(b.record(CallOutcome::Connection), (Change::Opened, true));
    assert!(b.is_open());
    assert_eq!(b.record(CallOutcome::Connection), (Change::None, false));
    assert_eq!(b.probed(false), (Change::None, true), "keeps probing");
    assert_eq!(b.probed(true), (Change::Closed, false));
    assert!(!b.is_open());
}

#[test]
fn a_timeout_only_makes_the_node_suspect() {
    let mut b = NodeBreaker::default();
    // many timeouts: one probe, and the breaker stays closed
    assert_eq!(b.record(CallOutcome::Timeout), (Change::None, true));
    for _ in 0..100 {
        assert_eq!(b.record(CallOutcome::Timeout), (Change::None, false));
    }
    assert!(!b.is_open(), "a load spike is not an outage");
    // the probe passes: busy, not sick; the next timeout probes again
    assert_eq!(b.probed(true), (Change::None, false));
    assert!(!b.is_open() && !b.blocks());
    assert_eq!(b.record(CallOutcome::Timeout), (Change::None, true));
    // this time the probe fails: open, and probing goes on
    assert_eq!(b.probed(false), (Change::Opened, true));
    assert!(b.is_open() && b.blocks());
    assert_eq!(b.probed(true), (Change::Closed, false));
    assert!(!b.blocks());
}

#[test]
fn timeouts_in_a_row_hold_calls_until_the_probe_answers() {
    let mut b = NodeBreaker::default();
    b.record(CallOutcome::Timeout);
    b.record(CallOutcome::Timeout);
    assert!(!b.blocks(), "two timeouts: still calling");
    b.record(CallOutcome::Answered);
    b.record(CallOutcome::Timeout);
    b.record(CallOutcome::Timeout);
    assert!(!b.blocks(), "an answer in between starts the count again");
    b.record(CallOutcome::Timeout);
    assert!(b.blocks() && !b.is_open(), "held, not open");
    // a busy node's probe answers: calls go through again
    assert_eq!(b.probed(true), (Change::None, false));
    assert!(!b.blocks());
    // a hung node's does not: open
    for _ in 0..OPEN_AFTER {
        b.record(CallOutcome::Timeout);
    }
    assert!(b.blocks());
    assert_eq!(b.probed(false), (Change::Opened, true));
    assert!(b.is_open());
}

/// Two nodes, "a" and "b": descriptors whose tag starts with `a` live on
/// node a. Each node can be up, hung (calls time out) or dead (refused).
#[derive(Default)]
struct TwoNodes {
    hung: [AtomicBool; 2],
    dead: [AtomicBool; 2],
    calls: [AtomicUsize; 2],
    probes: AtomicUsize,
}

fn index(node: &str) -> usize {
    usize::from(node != "a")
}

#[async_trait]
impl Store for TwoNodes {
    async fn decide(
        &self,
        descriptor: &DescriptorBuckets,
        _: Cost,
    ) -> Result<Vec<BucketOutcome>, StoreError> {
        let i = usize::from(descriptor.tag.first() != Some(&b'a'));
        self.calls[i].fetch_add(1, Ordering::SeqCst);
        if self.dead[i].load(Ordering::SeqCst) {
            return Err(StoreError::Connection("refused".into()));
        }
        if self.hung[i].load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(10)).await;
            return Err(StoreError::Timeout);
        }
        Ok(Vec::new())
    }
    fn name(&self) -> &'static str {
        "two"
    }
}

#[async_trait]
impl Nodes for TwoNodes {
    fn node_of(&self, descriptor: &DescriptorBuckets) -> Arc<str> {
        Arc::from(if descriptor.tag.first() == Some(&b'a') {
            "a"
        } else {
            "b"
        })
    }
    async fn probe(&self, node: &str) -> Result<(), StoreError> {
        self.probes.fetch_add(1, Ordering::SeqCst);
        let i = index(node);
        if self.dead[i].load(Ordering::SeqCst) || self.hung[i].load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(250)).await;
            Err(StoreError::Timeout)
        } else {
            Ok(())
        }
    }
    fn is_current(&self, _: &str) -> bool {
        true
    }
    fn describe(&self, node: &str) -> String {
        format!("node {node}")
    }
}

fn on(node: u8) -> DescriptorBuckets {
    DescriptorBuckets {
        tag: vec![node],
        buckets: Vec::new(),
        replication: None,
        ratelimit_key: None,
    }
}

fn setup() -> (Arc<TwoNodes>, Breakers<TwoNodes>) {
    let inner = Arc::new(TwoNodes::default());
    (
        inner.clone(),
        Breakers::new(inner, Arc::new(Metrics::new())),
    )
}

#[tokio::test(start_paused = true)]
async fn a_hung_node_opens_only_its_own_breaker_and_closes_when_it_thaws() {
    let (inner, breakers) = setup();
    inner.hung[0].store(true, Ordering::SeqCst);
    // node a hangs: three calls time out, then its calls are held while
    // the probe is out (250 ms) and fail at once when it fails; node b
    // decides throughout
    let mut timeouts = 0;
    for _ in 0..100 {
        match breakers.decide(&on(b'a'), Cost::Spend(1)).await {
            Err(StoreError::Timeout) => timeouts += 1,
            Err(StoreError::BreakerOpen) => {}
            other => panic!("{other:?}"),
        }
        assert!(breakers.decide(&on(b'b'), Cost::Spend(1)).await.is_ok());
    }
    tokio::time::sleep(Duration::from_millis(300)).await; // the probe fails
    assert!(breakers.is_open("a") && !breakers.is_open("b"));
    assert_eq!(timeouts, OPEN_AFTER, "a handful of timeouts");
    assert_eq!(breakers.open_nodes(), ["a"]);
    assert_eq!(inner.calls[1].load(Ordering::SeqCst), 100);
    // thawed: the next probe (every 500 ms) closes it
    inner.hung[0].store(false, Ordering::SeqCst);
    tokio::time::sleep(PROBE_EVERY * 2).await;
    assert!(!breakers.is_open("a"));
    assert!(breakers.decide(&on(b'a'), Cost::Spend(1)).await.is_ok());
}

#[tokio::test(start_paused = true)]
async fn a_dead_node_costs_three_calls() {
    let (inner, breakers) = setup();
    inner.dead[1].store(true, Ordering::SeqCst);
    for _ in 0..50 {
        let _ = breakers.decide(&on(b'b'), Cost::Spend(1)).await;
    }
    assert_eq!(inner.calls[1].load(Ordering::SeqCst), OPEN_AFTER as usize);
    assert!(breakers.is_open("b") && !breakers.is_open("a"));
    assert!(breakers.decide(&on(b'a'), Cost::Spend(1)).await.is_ok());
    tokio::time::sleep(PROBE_EVERY * 3).await;
    assert!(breakers.is_open("b"), "probes fail while it is down");
    inner.dead[1].store(false, Ordering::SeqCst);
    tokio::time::sleep(PROBE_EVERY * 2).await;
    assert!(!breakers.is_open("b"));
}

#[tokio::test(start_paused = true)]
async fn timeouts_on_a_busy_but_healthy_node_keep_it_closed() {
    // Timeouts come from a spike, not from the node: its probes pass.
    struct Busy(AtomicUsize);
    #[async_trait]
    impl Store for Busy {
        async fn decide(
            &self,
            _: &DescriptorBuckets,
            _: Cost,
        ) -> Result<Vec<BucketOutcome>, StoreError> {
            // every other call times out
            if self.0.fetch_add(1, Ordering::SeqCst).is_multiple_of(2) {
                Err(StoreError::Timeout)
            } else {
                Ok(Vec::new())
            }
        }
        fn name(&self) -> &'static str {
            "busy"
        }
    }
    #[async_trait]
    impl Nodes for Busy {
        fn node_of(&self, _: &DescriptorBuckets) -> Arc<str> {
            Arc::from("a")
        }
        async fn probe(&self, _: &str) -> Result<(), StoreError> {
            Ok(())
        }
        fn is_current(&self, _: &str) -> bool {
            true
        }
        fn describe(&self, _: &str) -> String {
            String::new()
        }
    }
    let breakers = Breakers::new(
        Arc::new(Busy(AtomicUsize::new(0))),
        Arc::new(Metrics::new()),
    );
    let mut answered = 0;
    for _ in 0..1000 {
        if breakers.decide(&on(b'a'), Cost::Spend(1)).await.is_ok() {
            answered += 1;
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(answered, 500, "every call reached the node");
    assert!(!breakers.is_open("a"));
}

#[tokio::test(start_paused = true)]
async fn a_call_cut_short_by_the_callers_deadline_counts_as_a_timeout() {
    let (inner, breakers) = setup();
    inner.hung[0].store(true, Ordering::SeqCst);
    // the caller gives up after 1 ms, before the store's own 10 ms timeout
    let mut cut = 0;
    for _ in 0..400 {
        let call = tokio::time::timeout(
            Duration::from_millis(1),
            breakers.decide(&on(b'a'), Cost::Spend(1)),
        )
        .await;
        match call {
            Err(_) => cut += 1,
            Ok(Err(StoreError::BreakerOpen)) => {}
            other => panic!("{other:?}"),
        }
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(breakers.is_open("a"), "the probe ran and failed");
    assert_eq!(cut, OPEN_AFTER, "three cut calls, then held, then open");
}

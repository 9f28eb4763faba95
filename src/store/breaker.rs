//! Circuit breakers, one per store node, so that a dead or hung Redis node
//! costs a few timeouts instead of one per request, and only for the
//! descriptors whose slots that node owns.
//!
//! [`NodeBreaker`] is the pure state machine; [`Breakers`] wraps a store that
//! can say which node decides a descriptor ([`Nodes`]) and runs the probes.
//!
//! A breaker opens on evidence that its node is failing, never on one busy
//! moment:
//! - [`OPEN_AFTER`] consecutive connection failures (refused, reset, not
//!   connected) open it: nothing else looks like that;
//! - a timeout only makes the node *suspect*: one probe (a PING on a
//!   connection of its own, with a deadline of its own, [`Nodes::probe`])
//!   is sent, and only a failed probe opens the breaker. A node that is slow
//!   because of a load spike still answers a PING on an idle connection, so
//!   the breaker stays closed and decisions stay exact. After [`OPEN_AFTER`]
//!   timeouts in a row while the probe is out, the node's calls are *held*
//!   (answered by the failure mode) until the probe answers: a busy node's
//!   PING comes back within about a millisecond, a hung node's never does,
//!   so a hung node costs a handful of timeouts, not a probe's worth;
//! - while open, calls to that node fail at once ([`StoreError::BreakerOpen`]:
//!   the rule's failure mode answers) and the node is probed every
//!   [`PROBE_EVERY`]; the first passing probe closes it. No restart needed.
//!
//! Nodes are named by the store (a primary's `host:port`): after a failover
//! or a reshard the slots map to another node, whose breaker is its own.
//! One log line per node when its breaker opens and when it closes.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use parking_lot::{Mutex, RwLock};

use super::{AttemptOutcome, DescriptorBuckets, Store, StoreError};
use crate::attempt::{AttemptCall, Phase, SlotOutcome};
use crate::bucket::{BucketOutcome, Cost};
use crate::labels::RuleId;
use crate::telemetry::Metrics;

/// Consecutive connection failures that open a node's breaker.
pub const OPEN_AFTER: u32 = 3;
/// How often an open breaker probes its node.
pub const PROBE_EVERY: Duration = Duration::from_millis(500);

/// What one store call to a node came to, as far as its health goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallOutcome {
    /// An answer (a script error is an answer too: the node is up).
    Answered,
    Timeout,
    Connection,
}

impl CallOutcome {
    pub fn of<T>(result: &Result<T, StoreError>) -> Option<Self> {
        match result {
            // the primary answered (its replicas may be slow or gone)
            Ok(_)
            | Err(
                StoreError::Script(_) | StoreError::OutOfMemory(_) | StoreError::NotReplicated(_),
            ) => Some(CallOutcome::Answered),
            Err(StoreError::Timeout) => Some(CallOutcome::Timeout),
            Err(StoreError::Connection(_)) => Some(CallOutcome::Connection),
            Err(StoreError::BreakerOpen | StoreError::Overloaded | StoreError::Upstream) => None,
        }
    }
}

/// What a probe result changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    None,
    Opened,
    Closed,
}

/// One node's breaker: pure state, driven by call outcomes and probe results.
#[derive(Debug, Default, Clone)]
pub struct NodeBreaker {
    open: bool,
    connection_errors: u32,
    /// Timeouts since the node last answered.
    timeouts: u32,
    /// A probe task runs for this node.
    probing: bool,
}

impl NodeBreaker {
    pub fn is_open(&self) -> bool {
        self.open
    }

    /// Whether calls to the node are answered by the failure mode now:
    /// open, or held while a suspect node's probe is out.
    pub fn blocks(&self) -> bool {
        self.open || (self.probing && self.timeouts >= OPEN_AFTER)
    }

    /// Whether the node is known to be alive: closed, its last call
    /// answered, no probe out. Then a call may wait for it as long as the
    /// caller can; while it is suspect, only the store's short timeout.
    pub fn trusted(&self) -> bool {
        !self.open && !self.probing && self.timeouts == 0 && self.connection_errors == 0
    }

    /// Records a call's outcome. Returns (what changed, whether the caller
    /// must start the probe task).
    pub fn record(&mut self, outcome: CallOutcome) -> (Change, bool) {
        match outcome {
            CallOutcome::Answered => {
                self.connection_errors = 0;
                self.timeouts = 0;
                (Change::None, false)
            }
            CallOutcome::Connection => {
                self.connection_errors += 1;
                if !self.open && self.connection_errors >= OPEN_AFTER {
                    self.open = true;
                    (Change::Opened, self.start_probe())
                } else {
                    (Change::None, false)
                }
            }
            CallOutcome::Timeout if !self.open => {
                self.timeouts += 1;
                (Change::None, self.start_probe())
            }
            CallOutcome::Timeout => (Change::None, false),
        }
    }

    fn start_probe(&mut self) -> bool {
        !std::mem::replace(&mut self.probing, true)
    }

    /// A probe's result. Returns what changed and whether to probe again
    /// (after [`PROBE_EVERY`]); when not, the probe task has ended.
    pub fn probed(&mut self, ok: bool) -> (Change, bool) {
        let (change, again) = self.probe_result(ok);
        if !again {
            self.probing = false;
        }
        (change, again)
    }

    fn probe_result(&mut self, ok: bool) -> (Change, bool) {
        match (self.open, ok) {
            (false, true) => {
                self.timeouts = 0; // busy, not sick: held calls go through again
                (Change::None, false)
            }
            (false, false) => {
                self.open = true;
                (Change::Opened, true)
            }
            (true, true) => {
                self.open = false;
                self.connection_errors = 0;
                self.timeouts = 0;
                (Change::Closed, false)
            }
            (true, false) => (Change::None, true),
        }
    }
}

/// A store that knows which node decides each descriptor.
#[async_trait]
pub trait Nodes: Send + Sync + 'static {
    /// The node that owns `descriptor`'s slot now (a primary's `host:port`).
    fn node_of(&self, descriptor: &DescriptorBuckets) -> Arc<str>;

    /// A cheap round trip to `node` on a connection and deadline of its own.
    async fn probe(&self, node: &str) -> Result<(), StoreError>;

    /// Whether `node` still owns slots (a failed-over or removed primary
    /// does not; its breaker is then forgotten).
    fn is_current(&self, node: &str) -> bool;

    /// What `node` covers, for log lines (e.g. `slots 0-5460`).
    fn describe(&self, node: &str) -> String;
}

/// One node's breaker and whether it blocks calls, read without the lock.
struct Cell {
    blocked: AtomicBool,
    state: Mutex<NodeBreaker>,
}

impl Cell {
    /// Applies `f` to the state and republishes whether it blocks calls.
    fn update<T>(&self, f: impl FnOnce(&mut NodeBreaker) -> T) -> T {
        let mut state = self.state.lock();
        let out = f(&mut state);
        self.blocked.store(state.blocks(), Ordering::Release);
        out
    }
}

/// A store behind one breaker per node.
pub struct Breakers<S> {
    inner: Arc<S>,
    cells: Arc<RwLock<HashMap<Arc<str>, Arc<Cell>>>>,
    metrics: Arc<Metrics>,
}

impl<S: Store + Nodes> Breakers<S> {
    pub fn new(inner: Arc<S>, metrics: Arc<Metrics>) -> Self {
        Self {
            inner,
            cells: Arc::default(),
            metrics,
        }
    }

    fn cell(&self, node: &Arc<str>) -> Arc<Cell> {
        if let Some(cell) = self.cells.read().get(node) {
            return cell.clone();
        }
        self.cells
            .write()
            .entry(node.clone())
            .or_insert_with(|| {
                self.metrics.node_seen(node);
                Arc::new(Cell {
                    blocked: AtomicBool::new(false),
                    state: Mutex::new(NodeBreaker::default()),
                })
            })
            .clone()
    }

    /// Whether `node`'s breaker is open now.
    pub fn is_open(&self, node: &str) -> bool {
        self.cells
            .read()
            .get(node)
            .is_some_and(|c| c.state.lock().is_open())
    }

    /// The nodes whose breaker is open now.
    pub fn open_nodes(&self) -> Vec<String> {
        let mut open: Vec<String> = self
            .cells
            .read()
            .iter()
            .filter(|(_, c)| c.state.lock().is_open())
            .map(|(n, _)| n.to_string())
            .collect();
        open.sort();
        open
    }

    fn apply(&self, node: &Arc<str>, change: Change) {
        match change {
            Change::None => {}
            Change::Opened => {
                self.metrics.breaker_open(node, true);
                tracing::warn!(
                    node = %node,
                    covers = %self.inner.describe(node),
                    "circuit breaker open: this Redis node is failing; its descriptors answer by their failure mode until it recovers"
                );
            }
            Change::Closed => {
                self.metrics.breaker_open(node, false);
                tracing::info!(
                    node = %node,
                    covers = %self.inner.describe(node),
                    "circuit breaker closed: this Redis node answers again"
                );
            }
        }
    }

    fn spawn_probe(&self, node: Arc<str>, cell: Arc<Cell>) {
        let this = Self {
            inner: self.inner.clone(),
            cells: self.cells.clone(),
            metrics: self.metrics.clone(),
        };
        crate::background::spawn(async move {
            loop {
                let ok = this.inner.probe(&node).await.is_ok();
                let (change, again) = cell.update(|s| s.probed(ok));
                this.apply(&node, change);
                if !again {
                    return;
                }
                if !this.inner.is_current(&node) {
                    // failed over or removed: its slots have another owner
                    tracing::info!(node = %node, "Redis node no longer owns slots; forgetting its breaker");
                    this.metrics.breaker_open(&node, false);
                    this.cells.write().remove(&node);
                    return;
                }
                tokio::time::sleep(PROBE_EVERY).await;
            }
        });
    }
}

/// A call in flight to one node; records a timeout if dropped unfinished.
struct Pending<'a, S: Store + Nodes> {
    breakers: &'a Breakers<S>,
    node: Arc<str>,
    cell: Arc<Cell>,
    done: bool,
}

impl<S: Store + Nodes> Pending<'_, S> {
    fn record(&self, outcome: CallOutcome) {
        let kind = match outcome {
            CallOutcome::Timeout => Some("timeout"),
            CallOutcome::Connection => Some("connection"),
            CallOutcome::Answered => None,
        };
        if let Some(kind) = kind {
            self.breakers.metrics.node_error(&self.node, kind);
        }
        let (change, probe) = self.cell.update(|s| s.record(outcome));
        self.breakers.apply(&self.node, change);
        if probe {
            self.breakers
                .spawn_probe(self.node.clone(), self.cell.clone());
        }
    }
}

impl<S: Store + Nodes> Drop for Pending<'_, S> {
    fn drop(&mut self) {
        if !self.done {
            self.record(CallOutcome::Timeout);
        }
    }
}

impl<S: Store + Nodes> Breakers<S> {
    /// The store behind the breakers.
    pub fn inner(&self) -> &Arc<S> {
        &self.inner
    }

    /// `call` on `node` through its breaker: refused at once while it is
    /// open, told `patience` only when the node is trusted, and its outcome
    /// recorded (a call cut short by the caller's deadline, this future
    /// dropped, counts as a timeout of the node). For calls that are not a
    /// descriptor's, such as the RLQS ledger's steps.
    pub async fn guard_node<T, F, Fut>(
        &self,
        node: Arc<str>,
        patience: Option<std::time::Duration>,
        call: F,
    ) -> Result<T, StoreError>
    where
        F: FnOnce(Option<std::time::Duration>) -> Fut,
        Fut: std::future::Future<Output = Result<T, StoreError>>,
    {
        let cell = self.cell(&node);
        if cell.blocked.load(Ordering::Acquire) {
            return Err(StoreError::BreakerOpen);
        }
        let patience = patience.filter(|_| cell.state.lock().trusted());
        let mut pending = Pending {
            breakers: self,
            node,
            cell,
            done: false,
        };
        let result = call(patience).await;
        pending.done = true;
        if let Some(outcome) = CallOutcome::of(&result) {
            pending.record(outcome);
        }
        result
    }
}

#[async_trait]
impl<S: Store + Nodes> Store for Breakers<S> {
    async fn decide(
        &self,
        descriptor: &DescriptorBuckets,
        cost: Cost,
    ) -> Result<Vec<BucketOutcome>, StoreError> {
        self.decide_patiently(descriptor, cost, None).await
    }

    /// Waits up to `patience` for a node its breaker trusts (a busy node
    /// still answers: a 50 ms timeout would hand its callers to the failure
    /// mode while their deadline had room), and only the store's short
    /// timeout for a suspect one.
    async fn decide_patiently(
        &self,
        descriptor: &DescriptorBuckets,
        cost: Cost,
        patience: Option<std::time::Duration>,
    ) -> Result<Vec<BucketOutcome>, StoreError> {
        self.guard_node(self.inner.node_of(descriptor), patience, |patience| {
            self.inner.decide_patiently(descriptor, cost, patience)
        })
        .await
    }

    /// As [`Store::decide_patiently`], through the same breaker.
    async fn decide_slot(
        &self,
        descriptor: &DescriptorBuckets,
        max: u64,
        call: &AttemptCall,
        rule: RuleId,
        patience: Option<std::time::Duration>,
    ) -> Result<SlotOutcome, StoreError> {
        if call.phase == Phase::Withdraw {
            return self
                .inner
                .decide_slot(descriptor, max, call, rule, patience)
                .await;
        }
        self.guard_node(self.inner.node_of(descriptor), patience, |patience| {
            self.inner
                .decide_slot(descriptor, max, call, rule, patience)
        })
        .await
    }

    /// As [`Store::decide_patiently`], through the same breaker.
    async fn decide_attempt(
        &self,
        descriptor: &DescriptorBuckets,
        cost: Cost,
        call: &AttemptCall,
        patience: Option<std::time::Duration>,
    ) -> Result<AttemptOutcome, StoreError> {
        // a withdrawal follows a start that timed out, on its connection:
        // sent whatever the breaker thinks of the node now (the timeouts
        // that opened it are the starts it must follow), and not counted
        if call.phase == Phase::Withdraw {
            return self
                .inner
                .decide_attempt(descriptor, cost, call, patience)
                .await;
        }
        self.guard_node(self.inner.node_of(descriptor), patience, |patience| {
            self.inner.decide_attempt(descriptor, cost, call, patience)
        })
        .await
    }

    /// An operator's reset goes to the store whatever the breaker says
    /// (rare, and asked by hand: its error is the answer).
    async fn forget(&self, descriptor: &DescriptorBuckets) -> Result<u64, StoreError> {
        self.inner.forget(descriptor).await
    }

    /// The inspector's reads, likewise.
    async fn held(&self, descriptor: &DescriptorBuckets) -> Result<super::Held, StoreError> {
        self.inner.held(descriptor).await
    }

    fn key_names(&self, descriptor: &DescriptorBuckets) -> Vec<String> {
        self.inner.key_names(descriptor)
    }

    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn reachable(&self) -> bool {
        self.open_nodes().is_empty() && self.inner.reachable()
    }

    fn warnings(&self) -> Vec<String> {
        let mut w = self.inner.warnings();
        for node in self.open_nodes() {
            w.push(format!(
                "{node}: circuit breaker open ({}); its descriptors answer by their failure mode",
                self.inner.describe(&node)
            ));
        }
        w
    }
}

#[cfg(test)]
mod tests;

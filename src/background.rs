//! Where work that outlives the call starting it runs (a lease's store
//! calls, a breaker's probe): on the main runtime, also when the call is
//! served on one of [`crate::serving`]'s threads, so that a serving thread's
//! runtime holds nothing but its connections and can stop with them. And
//! which serving thread this is ([`serving_thread`]), for a store that keeps
//! connections of its own on each.
//!
//! **Layer** (docs/architecture.md, "Layers", kept by `tests/layers.rs`): a
//! leaf: uses nothing of the crate.

use std::cell::{Cell, RefCell};
use std::future::Future;

use tokio::runtime::Handle;
use tokio::task::JoinHandle;

thread_local! {
    /// On a serving thread: the main runtime.
    static MAIN_RUNTIME: RefCell<Option<Handle>> = const { RefCell::new(None) };
    /// On a serving thread: its number, from 0.
    static SERVING_THREAD: Cell<Option<usize>> = const { Cell::new(None) };
}

/// The number of the serving thread this runs on (from 0); `None` off the
/// serving threads (the main runtime, TLS, tests).
pub fn serving_thread() -> Option<usize> {
    SERVING_THREAD.with(Cell::get)
}

/// Marks this thread as serving thread `index` (the serving threads do it
/// themselves; tests make their own).
pub fn mark_serving_thread(index: usize) {
    SERVING_THREAD.with(|t| t.set(Some(index)));
}

/// Makes this thread's background work go to `main`.
pub fn run_on(main: Handle) {
    MAIN_RUNTIME.with(|m| *m.borrow_mut() = Some(main));
}

/// Spawns `work` on the main runtime from a serving thread, else on the
/// current runtime.
pub fn spawn<F>(work: F) -> JoinHandle<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    MAIN_RUNTIME.with(|main| match &*main.borrow() {
        Some(handle) => handle.spawn(work),
        None => tokio::spawn(work),
    })
}

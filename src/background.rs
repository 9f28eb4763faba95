//! Where work that outlives the call starting it runs (a lease's store
//! calls, a breaker's probe): on the main runtime, also when the call is
//! served on one of [`crate::serving`]'s threads, so that a serving thread's
//! runtime holds nothing but its connections and can stop with them.

use std::cell::RefCell;
use std::future::Future;

use tokio::runtime::Handle;
use tokio::task::JoinHandle;

thread_local! {
    /// On a serving thread: the main runtime.
    static MAIN_RUNTIME: RefCell<Option<Handle>> = const { RefCell::new(None) };
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

//! Hot reload with real files, the real watcher and a running server: every
//! way operators and Kubernetes change rule files, invalid and half-written
//! changes, bucket state across reloads, and reloads under traffic.

mod common;

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{descriptor, request, serve_args};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use tokenbucket_rls::server::{self, RunningServer};
use tokenbucket_rls::sources::reload::ReloadOutcome;
use tonic::transport::Channel;

/// How soon a change must be applied or rejected.
const APPLIED_WITHIN: Duration = Duration::from_secs(2);

/// A rules file for domain `d` whose `k` descriptor allows `rpu` per minute.
fn rules(domain: &str, rpu: u32) -> String {
    format!("domain: {domain}\ndescriptors:\n  - key: k\n    rate_limit: {{unit: minute, requests_per_unit: {rpu}}}\n")
}

struct Running {
    server: RunningServer,
    client: RateLimitServiceClient<Channel>,
}

async fn serve(config: &Path) -> Running {
    let server = server::start(&serve_args(config.to_path_buf()))
        .await
        .expect("server starts");
    let client = RateLimitServiceClient::connect(format!("http://{}", server.grpc_addr))
        .await
        .expect("connect");
    Running { server, client }
}

impl Running {
    /// The requests_per_unit answering for (k, value) in `domain`, 0 for none.
    async fn limit(&mut self, domain: &str, value: &str) -> u32 {
        let r = self
            .client
            .should_rate_limit(request(domain, vec![descriptor(&[("k", value)])]))
            .await
            .expect("answered")
            .into_inner();
        r.statuses[0]
            .current_limit
            .as_ref()
            .map_or(0, |l| l.requests_per_unit)
    }

    /// Waits (2 s at most, DESIGN §3) until (k, value) in `domain` answers with `rpu`.
    async fn expect_limit(&mut self, domain: &str, rpu: u32, what: &str) {
        let deadline = Instant::now() + APPLIED_WITHIN;
        loop {
            let now = self.limit(domain, "probe").await;
            if now == rpu {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: still {now}, expected {rpu} after {APPLIED_WITHIN:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// rls_config_reloads_total for ok and error.
    fn counts(&self) -> (u64, u64) {
        let m = &self.server.metrics;
        (m.reloads("ok"), m.reloads("error"))
    }
}

fn write(path: &Path, text: &str) {
    std::fs::write(path, text).expect("write");
}

#[tokio::test]
async fn in_place_edit() {
    let dir = tempfile::tempdir().expect("tempdir");
    write(&dir.path().join("r.yaml"), &rules("d", 5));
    let mut s = serve(dir.path()).await;
    assert_eq!(s.limit("d", "probe").await, 5);
    write(&dir.path().join("r.yaml"), &rules("d", 7));
    s.expect_limit("d", 7, "edited in place").await;
    assert_eq!(s.server.rules.load().generation(), 2);
}

#[tokio::test]
async fn a_single_file_path_is_watched_too() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("only.yaml");
    write(&file, &rules("d", 5));
    let mut s = serve(&file).await;
    write(&file, &rules("d", 8));
    s.expect_limit("d", 8, "single file edited").await;
}

#[tokio::test]
async fn mv_of_a_temp_file_over_the_rules() {
    let dir = tempfile::tempdir().expect("tempdir");
    write(&dir.path().join("r.yaml"), &rules("d", 5));
    let mut s = serve(dir.path()).await;
    let tmp = dir.path().join(".r.yaml.tmp");
    write(&tmp, &rules("d", 9));
    std::fs::rename(&tmp, dir.path().join("r.yaml")).expect("mv");
    s.expect_limit("d", 9, "mv over").await;
}

#[tokio::test]
async fn sed_in_place() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("r.yaml");
    write(&file, &rules("d", 5));
    let mut s = serve(dir.path()).await;
    let status = std::process::Command::new("sed")
        .args(["-i", "s/requests_per_unit: 5/requests_per_unit: 11/"])
        .arg(&file)
        .status()
        .expect("sed");
    assert!(status.success());
    s.expect_limit("d", 11, "sed -i").await;
}

#[tokio::test]
async fn new_and_removed_files() {
    let dir = tempfile::tempdir().expect("tempdir");
    write(&dir.path().join("a.yaml"), &rules("a", 5));
    let mut s = serve(dir.path()).await;
    assert_eq!(s.limit("b", "probe").await, 0);
    write(&dir.path().join("b.yaml"), &rules("b", 6));
    s.expect_limit("b", 6, "new file").await;
    std::fs::remove_file(dir.path().join("b.yaml")).expect("rm");
    s.expect_limit("b", 0, "removed file").await;
    assert_eq!(
        s.limit("a", "probe").await,
        5,
        "the other file's rules stay"
    );
}

#[cfg(unix)]
#[tokio::test]
async fn kubernetes_configmap_symlink_swap() {
    use std::os::unix::fs::symlink;
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    // The kubelet's layout: a timestamped directory, `..data` pointing at it,
    // and each key a symlink through `..data`.
    std::fs::create_dir(d.join("..2026_12_01")).expect("mkdir");
    write(&d.join("..2026_12_01/rules.yaml"), &rules("d", 5));
    symlink("..2026_12_01", d.join("..data")).expect("ln ..data");
    symlink("..data/rules.yaml", d.join("rules.yaml")).expect("ln rules.yaml");
    let mut s = serve(d).await;
    assert_eq!(s.limit("d", "probe").await, 5);

    // An update: new directory, new `..data_tmp` link renamed over `..data`,
    // old directory removed.
    std::fs::create_dir(d.join("..2026_12_02")).expect("mkdir");
    write(&d.join("..2026_12_02/rules.yaml"), &rules("d", 12));
    symlink("..2026_12_02", d.join("..data_tmp")).expect("ln tmp");
    std::fs::rename(d.join("..data_tmp"), d.join("..data")).expect("swap");
    std::fs::remove_dir_all(d.join("..2026_12_01")).expect("rm old");
    s.expect_limit("d", 12, "ConfigMap swap").await;
    assert_eq!(s.counts().1, 0, "no error on the way");
}

#[tokio::test]
async fn the_watched_directory_is_replaced() {
    let base = tempfile::tempdir().expect("tempdir");
    let rules_dir = base.path().join("rules");
    std::fs::create_dir(&rules_dir).expect("mkdir");
    write(&rules_dir.join("r.yaml"), &rules("d", 5));
    let mut s = serve(&rules_dir).await;
    let next = base.path().join("rules.next");
    std::fs::create_dir(&next).expect("mkdir");
    write(&next.join("r.yaml"), &rules("d", 13));
    std::fs::rename(&rules_dir, base.path().join("rules.old")).expect("mv away");
    std::fs::rename(&next, &rules_dir).expect("mv in");
    s.expect_limit("d", 13, "directory replaced").await;
    // and the new directory is watched in turn
    write(&rules_dir.join("r.yaml"), &rules("d", 14));
    s.expect_limit("d", 14, "edit in the new directory").await;
}

#[tokio::test]
async fn an_invalid_change_is_rejected_whole_and_counted_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    write(&dir.path().join("a.yaml"), &rules("a", 5));
    write(&dir.path().join("b.yaml"), &rules("b", 6));
    let mut s = serve(dir.path()).await;
    // one good edit and one bad file in the same change
    write(&dir.path().join("a.yaml"), &rules("a", 50));
    write(
        &dir.path().join("b.yaml"),
        "domain: b\ndescriptors:\n  - key: k\n    ratelimit: {unit: minute}\n",
    );
    let deadline = Instant::now() + APPLIED_WITHIN;
    while s.counts().1 == 0 {
        assert!(
            Instant::now() < deadline,
            "the invalid change was never seen"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(1500)).await; // a rescan or two later
    assert_eq!(s.counts(), (0, 1), "rejected once, not once per rescan");
    assert_eq!(
        s.limit("a", "probe").await,
        5,
        "the good half was not applied"
    );
    assert_eq!(s.limit("b", "probe").await, 6, "the old rules keep serving");
    assert_eq!(s.server.rules.load().generation(), 1);
    // fixing it applies both
    write(&dir.path().join("b.yaml"), &rules("b", 60));
    s.expect_limit("b", 60, "fixed").await;
    assert_eq!(s.limit("a", "probe").await, 50);
}

#[tokio::test]
async fn half_written_and_emptied_files_are_not_no_rules() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("r.yaml");
    write(&file, &rules("d", 5));
    let s = serve(dir.path()).await;
    let reloader = s.server.reloader.clone();
    write(&file, "");
    assert_eq!(
        reloader.reload(false),
        ReloadOutcome::Rejected,
        "an emptied file"
    );
    write(&file, "domain: d\ndescriptors:\n");
    assert_eq!(
        reloader.reload(false),
        ReloadOutcome::Rejected,
        "cut short after `descriptors:`"
    );
    write(
        &file,
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: min",
    );
    assert_eq!(
        reloader.reload(false),
        ReloadOutcome::Rejected,
        "cut mid-line"
    );
    std::fs::remove_file(&file).expect("rm");
    assert_eq!(
        reloader.reload(false),
        ReloadOutcome::Rejected,
        "every file gone"
    );
    let mut s = s;
    assert_eq!(s.limit("d", "probe").await, 5, "still the original rules");
    write(&file, &rules("d", 6));
    assert!(matches!(
        reloader.reload(false),
        ReloadOutcome::Applied { .. }
    ));
    assert_eq!(s.limit("d", "probe").await, 6);
}

#[tokio::test]
async fn buckets_survive_a_reload_of_other_rules() {
    let dir = tempfile::tempdir().expect("tempdir");
    write(&dir.path().join("r.yaml"), &rules("d", 3));
    let mut s = serve(dir.path()).await;
    for _ in 0..3 {
        s.limit("d", "spent").await;
    }
    let over =
        |r: &envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse| r.overall_code == 2;
    let call = |c: &mut RateLimitServiceClient<Channel>| {
        let mut c = c.clone();
        async move {
            c.should_rate_limit(request("d", vec![descriptor(&[("k", "spent")])]))
                .await
                .expect("answered")
                .into_inner()
        }
    };
    assert!(over(&call(&mut s.client).await), "empty before the reload");
    // another rule added: the unchanged rule keeps its empty bucket
    write(
        &dir.path().join("r.yaml"),
        &(rules("d", 3) + "  - key: other\n    rate_limit: {unit: second, requests_per_unit: 1}\n"),
    );
    assert!(matches!(
        s.server.reloader.reload(false),
        ReloadOutcome::Applied { .. }
    ));
    assert!(
        over(&call(&mut s.client).await),
        "still empty after the reload"
    );
    // a changed limit keeps the tokens, capped at the new burst
    write(&dir.path().join("r.yaml"), &rules("d", 30));
    assert!(matches!(
        s.server.reloader.reload(false),
        ReloadOutcome::Applied { .. }
    ));
    let r = call(&mut s.client).await;
    assert!(
        over(&r),
        "a raised limit does not refill a spent bucket at once"
    );
}

#[tokio::test]
async fn sighup_forces_a_reload() {
    let dir = tempfile::tempdir().expect("tempdir");
    write(&dir.path().join("r.yaml"), &rules("d", 5));
    let s = serve(dir.path()).await;
    assert_eq!(s.server.reloader.reload(false), ReloadOutcome::Unchanged);
    assert_eq!(
        s.server.reloader.reload(true),
        ReloadOutcome::Applied { generation: 2 }
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_reloads_under_traffic() {
    // Two descriptors in every request, always changed together: a decision
    // against a partial rule set would show them with different limits.
    let both = |rpu: u32| {
        format!("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {{unit: minute, requests_per_unit: {rpu}}}\n  - key: b\n    rate_limit: {{unit: minute, requests_per_unit: {rpu}}}\n")
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("r.yaml");
    write(&file, &both(1000));
    let s = serve(dir.path()).await;
    let stop = Arc::new(AtomicBool::new(false));
    let calls = Arc::new(AtomicUsize::new(0));
    let mut traffic = Vec::new();
    for t in 0..4 {
        let mut c = s.client.clone();
        let (stop, calls) = (stop.clone(), calls.clone());
        traffic.push(tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                let v = format!("t{t}");
                let r = c
                    .should_rate_limit(request(
                        "d",
                        vec![descriptor(&[("a", &v)]), descriptor(&[("b", &v)])],
                    ))
                    .await
                    .expect("no failed call during reloads")
                    .into_inner();
                let limits: Vec<u32> = r
                    .statuses
                    .iter()
                    .map(|s| s.current_limit.as_ref().map_or(0, |l| l.requests_per_unit))
                    .collect();
                assert_eq!(
                    limits[0], limits[1],
                    "one request saw two rule sets: {limits:?}"
                );
                assert!(limits[0] == 1000 || limits[0] == 2000, "{limits:?}");
                calls.fetch_add(1, Ordering::SeqCst);
            }
        }));
    }
    for i in 0..1000u32 {
        write(&file, &both(if i % 2 == 0 { 2000 } else { 1000 }));
        // The watcher may have applied this write already: Unchanged is fine.
        assert_ne!(
            s.server.reloader.reload(false),
            ReloadOutcome::Rejected,
            "reload {i}"
        );
        tokio::task::yield_now().await;
    }
    stop.store(true, Ordering::SeqCst);
    for t in traffic {
        t.await.expect("traffic task");
    }
    assert!(calls.load(Ordering::SeqCst) > 0);
    assert!(s.server.rules.load().generation() >= 1001);
}

/// Writes to `files` every 100 ms until dropped: the neighbours of a rules
/// directory on a busy machine (a log beside the rules, anything in /etc).
struct Neighbours {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<usize>>,
}

impl Neighbours {
    fn writing(files: Vec<std::path::PathBuf>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut writes = 0;
            while !flag.load(Ordering::SeqCst) {
                for f in &files {
                    use std::io::Write;
                    let mut out = std::fs::OpenOptions::new()
                        .create(true)
                        .append(true)
                        .open(f)
                        .expect("open neighbour");
                    writeln!(out, "line {writes}").expect("append");
                    writes += 1;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            writes
        });
        Self {
            stop,
            thread: Some(thread),
        }
    }
}

impl Neighbours {
    /// Stops the writing; how many writes there were.
    fn finish(mut self) -> usize {
        self.stop.store(true, Ordering::SeqCst);
        self.thread
            .take()
            .map_or(0, |t| t.join().expect("neighbour thread"))
    }
}

impl Drop for Neighbours {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(unix)]
#[tokio::test]
async fn every_change_is_applied_within_2s_while_neighbours_keep_writing() {
    use std::os::unix::fs::symlink;
    let base = tempfile::tempdir().expect("tempdir");
    let d = base.path().join("rules");
    std::fs::create_dir(&d).expect("mkdir");
    write(&d.join("a.yaml"), &rules("a", 5));
    // a ConfigMap-style key beside the plain file
    std::fs::create_dir(d.join("..v1")).expect("mkdir");
    write(&d.join("..v1/cm.yaml"), &rules("cm", 5));
    symlink("..v1", d.join("..data")).expect("ln ..data");
    symlink("..data/cm.yaml", d.join("cm.yaml")).expect("ln cm.yaml");
    let mut s = serve(&d).await;
    assert_eq!(s.limit("a", "probe").await, 5);
    assert_eq!(s.limit("cm", "probe").await, 5);
    // a log beside the rules and a file in the parent directory, both
    // written every 100 ms for the whole test
    let neighbours = Neighbours::writing(vec![d.join("app.log"), base.path().join("busy.log")]);

    write(&d.join("a.yaml"), &rules("a", 6));
    s.expect_limit("a", 6, "edited in place").await;

    let tmp = d.join(".a.yaml.tmp");
    write(&tmp, &rules("a", 7));
    std::fs::rename(&tmp, d.join("a.yaml")).expect("mv");
    s.expect_limit("a", 7, "mv over").await;

    write(&d.join("b.yaml"), &rules("b", 8));
    s.expect_limit("b", 8, "new file").await;
    std::fs::remove_file(d.join("b.yaml")).expect("rm");
    s.expect_limit("b", 0, "removed file").await;

    std::fs::create_dir(d.join("..v2")).expect("mkdir");
    write(&d.join("..v2/cm.yaml"), &rules("cm", 9));
    symlink("..v2", d.join("..data_tmp")).expect("ln tmp");
    std::fs::rename(d.join("..data_tmp"), d.join("..data")).expect("swap");
    std::fs::remove_dir_all(d.join("..v1")).expect("rm old");
    s.expect_limit("cm", 9, "ConfigMap swap").await;
    assert_eq!(s.counts(), (5, 0), "five reloads, no error so far");

    write(
        &d.join("a.yaml"),
        "domain: a\ndescriptors:\n  - key: k\n    ratelimit: {unit: minute}\n",
    );
    let deadline = Instant::now() + APPLIED_WITHIN;
    while s.counts().1 == 0 {
        assert!(
            Instant::now() < deadline,
            "invalid change not rejected within {APPLIED_WITHIN:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(s.limit("a", "probe").await, 7, "the old rules keep serving");
    write(&d.join("a.yaml"), &rules("a", 10));
    s.expect_limit("a", 10, "fixed").await;
    assert_eq!(s.counts(), (6, 1));

    let writes = neighbours.finish();
    assert!(
        writes >= 20,
        "the neighbours wrote throughout: {writes} writes"
    );
}

/// A log writer the test can read back.
#[derive(Clone, Default)]
struct Captured(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("log buffer").extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().expect("log buffer")).to_string()
    }
}

/// After a rejected change, putting the good file back is said in the log,
/// so that the last line is not still the error.
#[tokio::test]
async fn a_good_file_put_back_after_a_rejection_is_logged() {
    let logs = Captured::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let _logging = tracing::subscriber::set_default(subscriber);
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("r.yaml");
    write(&file, &rules("d", 5));
    let s = serve(dir.path()).await;
    write(
        &file,
        "domain: d\ndescriptors:\n  - key: k\n    ratelimit: {}\n",
    );
    assert_eq!(s.server.reloader.reload(false), ReloadOutcome::Rejected);
    assert!(
        logs.text().contains("rules change rejected"),
        "{}",
        logs.text()
    );
    write(&file, &rules("d", 5));
    assert_eq!(s.server.reloader.reload(false), ReloadOutcome::Unchanged);
    let text = logs.text();
    let last = text.lines().last().unwrap_or_default();
    assert!(
        last.contains("rules on disk are valid again, the same as the rules being served"),
        "{text}"
    );
    // and a different good file after a rejection is a reload that says so
    write(
        &file,
        "domain: d\ndescriptors:\n  - key: k\n    ratelimit: {}\n",
    );
    assert_eq!(s.server.reloader.reload(false), ReloadOutcome::Rejected);
    write(&file, &rules("d", 6));
    assert!(matches!(
        s.server.reloader.reload(false),
        ReloadOutcome::Applied { .. }
    ));
    assert!(
        logs.text()
            .lines()
            .last()
            .unwrap_or_default()
            .contains("rules on disk are valid again; reloaded"),
        "{}",
        logs.text()
    );
}

//! When to reload: which filesystem events concern the rules, and how long
//! to wait after them.
//!
//! Pure logic, no watcher and no clock of its own, so that it is tested with
//! made-up paths and instants. [`super::reload`] wires it to notify and Tokio.
//!
//! Two properties keep reloads prompt on a busy machine:
//! - [`RulesPath::concerns`] drops events about other files (a log beside the
//!   rules, anything else in the parent directory) in the watcher's callback,
//!   so they never reach the reload task;
//! - [`Debounce`] waits for a quiet moment but never longer than
//!   [`MAX_WAIT`] after the first event, so a steady stream of events that
//!   do concern the rules cannot postpone a reload either.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// How long the files must be quiet before a reload (an editor's burst of
/// events, a `cp` of several files, a ConfigMap swap).
pub const QUIET: Duration = Duration::from_millis(250);
/// The longest a reload waits after the first event, however many follow.
pub const MAX_WAIT: Duration = Duration::from_millis(1000);

/// The config path as the watcher sees it: the directory that holds the
/// rules (the config directory, or a single file's directory) and, for a
/// single file, that file's name.
#[derive(Debug, Clone)]
pub struct RulesPath {
    /// The directory as given and as canonicalised: events name it either
    /// way (the parent's watch reports the canonical form).
    dirs: Vec<PathBuf>,
    file: Option<PathBuf>,
}

impl RulesPath {
    /// `config` is `--config`: a directory of rule files, or one file.
    pub fn new(config: &Path) -> Self {
        let (dir, file) = if config.is_dir() {
            (config.to_path_buf(), None)
        } else {
            let dir = config
                .parent()
                .filter(|p| !p.as_os_str().is_empty())
                .map_or_else(|| PathBuf::from("."), Path::to_path_buf);
            (dir, config.file_name().map(PathBuf::from))
        };
        let mut dirs = vec![dir.clone()];
        if let Ok(canonical) = dir.canonicalize() {
            if canonical != dir {
                dirs.push(canonical);
            }
        }
        Self { dirs, file }
    }

    /// The directory to watch for edits, new, removed and renamed files and
    /// ConfigMap `..data` swaps.
    pub fn dir(&self) -> &Path {
        &self.dirs[0]
    }

    /// Its parent, watched for the directory itself being replaced.
    pub fn parent(&self) -> Option<PathBuf> {
        self.dir()
            .canonicalize()
            .ok()
            .and_then(|d| d.parent().map(Path::to_path_buf))
    }

    /// Whether an event about `path` can change the rules: the directory
    /// itself, a rule file in it (or the single file), or a dot-dot entry
    /// (Kubernetes' `..data` and its timestamped directories).
    pub fn concerns(&self, path: &Path) -> bool {
        if self.dirs.iter().any(|d| d == path) {
            return true;
        }
        let Some(parent) = path.parent() else {
            return false;
        };
        if !self.dirs.iter().any(|d| d == parent) {
            return false;
        }
        let Some(name) = path.file_name() else {
            return false;
        };
        if name.to_string_lossy().starts_with("..") {
            return true;
        }
        match &self.file {
            Some(file) => name == file.as_os_str(),
            None => is_rule_file_name(name),
        }
    }

    /// Whether an event with these paths concerns the rules. An event that
    /// names no path (the kernel's queue overflowed) might, so it does.
    pub fn concerns_any<'a>(&self, mut paths: impl Iterator<Item = &'a PathBuf>) -> bool {
        let mut none = true;
        let hit = paths.any(|p| {
            none = false;
            self.concerns(p)
        });
        hit || none
    }
}

/// A name the loader reads: `*.yaml` or `*.yml`, not hidden.
pub fn is_rule_file_name(name: &OsStr) -> bool {
    let name = name.to_string_lossy();
    !name.starts_with('.') && (name.ends_with(".yaml") || name.ends_with(".yml"))
}

/// Quiet-period debounce with a maximum wait.
#[derive(Debug, Default)]
pub struct Debounce {
    /// The first and the latest event since the last reload.
    pending: Option<(Instant, Instant)>,
}

impl Debounce {
    /// Notes an event at `now`.
    pub fn event(&mut self, now: Instant) {
        self.pending = Some(match self.pending {
            Some((first, _)) => (first, now),
            None => (now, now),
        });
    }

    /// When the reload is due: [`QUIET`] after the latest event, but no later
    /// than [`MAX_WAIT`] after the first. None when nothing is pending.
    pub fn due(&self) -> Option<Instant> {
        self.pending
            .map(|(first, last)| (last + QUIET).min(first + MAX_WAIT))
    }

    /// The reload is starting: the events so far are covered by it.
    pub fn clear(&mut self) {
        self.pending = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_steady_stream_of_events_cannot_postpone_the_reload() {
        let t0 = Instant::now();
        let mut d = Debounce::default();
        assert_eq!(d.due(), None);
        d.event(t0);
        assert_eq!(d.due(), Some(t0 + QUIET));
        // an event every 100 ms for ever: due stays at first + MAX_WAIT
        for i in 1..100 {
            d.event(t0 + Duration::from_millis(100 * i));
        }
        assert_eq!(d.due(), Some(t0 + MAX_WAIT));
        d.clear();
        assert_eq!(d.due(), None);
        let t1 = t0 + Duration::from_secs(20);
        d.event(t1);
        d.event(t1 + Duration::from_millis(100));
        assert_eq!(d.due(), Some(t1 + Duration::from_millis(100) + QUIET));
    }

    #[test]
    fn only_the_rules_path_concerns_the_watcher() {
        let base = tempfile::tempdir().expect("tempdir");
        let rules = base.path().join("rules");
        std::fs::create_dir(&rules).expect("mkdir");
        let p = RulesPath::new(&rules);
        assert!(p.concerns(&rules), "the directory itself (replaced)");
        assert!(p.concerns(&rules.join("a.yaml")));
        assert!(p.concerns(&rules.join("b.yml")));
        assert!(p.concerns(&rules.join("..data")), "ConfigMap swap");
        assert!(p.concerns(&rules.join("..2026_12_03_01")));
        assert!(
            !p.concerns(&rules.join("app.log")),
            "a log beside the rules"
        );
        assert!(
            !p.concerns(&rules.join(".a.yaml.swp")),
            "an editor's swap file"
        );
        assert!(
            !p.concerns(&base.path().join("other.yaml")),
            "the parent's other files"
        );
        assert!(!p.concerns(&rules.join("sub/a.yaml")), "not recursive");
        assert!(p.concerns_any([].iter()), "an event without paths might");
        assert!(!p.concerns_any([base.path().join("x")].iter()));

        let file = rules.join("only.yaml");
        std::fs::write(&file, "").expect("write");
        let p = RulesPath::new(&file);
        assert_eq!(p.dir(), rules);
        assert!(p.concerns(&file));
        assert!(
            !p.concerns(&rules.join("a.yaml")),
            "another file beside the one"
        );
        assert!(p.concerns(&rules.join("..data")));
        // the canonical form, as the parent's watch reports it
        let canonical = rules.canonicalize().expect("canonical");
        assert!(RulesPath::new(&rules).concerns(&canonical));
    }
}

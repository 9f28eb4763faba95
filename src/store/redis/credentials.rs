//! A Redis password kept in a file that is replaced when it rotates
//! (a Kubernetes Secret's mount, an ElastiCache IAM or Azure Entra token
//! written by a sidecar): read again for every connection opened, so each
//! new connection authenticates with the newest; connections already open
//! stay authenticated, as Redis keeps them.
//!
//! The file holds the password only (one line; a final newline is not part
//! of it); the user, if any, is the URL's. What it holds is never printed:
//! errors name the file.
//!
//! **Layer:** store (the Redis store's rooms). Reads the file; fred's
//! connections ask it through [`CredentialProvider`], ours through
//! [`super::pipe`]'s connect.

use std::path::{Path, PathBuf};

use fred::error::{Error as RedisError, ErrorKind};
use fred::types::config::{CredentialProvider, Server};

/// The most a password file may hold (an IAM token is about 1 kB).
const MAX_BYTES: u64 = 64 * 1024;

/// The password file, and the URL's user.
#[derive(Debug)]
pub struct PasswordFile {
    path: PathBuf,
    username: Option<String>,
}

impl PasswordFile {
    /// Checks that `path` holds a password now (a missing or empty file is
    /// a mistake at start-up, not a rotation).
    pub fn new(path: &Path, username: Option<String>) -> Result<Self, String> {
        let file = Self {
            path: path.to_path_buf(),
            username,
        };
        file.read()?;
        Ok(file)
    }

    /// The password the file holds now.
    pub fn read(&self) -> Result<String, String> {
        let shown = self.path.display();
        let meta = std::fs::metadata(&self.path)
            .map_err(|e| format!("the Redis password file {shown}: {e}"))?;
        if meta.len() > MAX_BYTES {
            return Err(format!(
                "the Redis password file {shown} holds {} bytes, more than a password ({MAX_BYTES} at most)",
                meta.len()
            ));
        }
        let bytes = std::fs::read(&self.path)
            .map_err(|e| format!("the Redis password file {shown}: {e}"))?;
        let text = String::from_utf8(bytes)
            .map_err(|_| format!("the Redis password file {shown} is not UTF-8 text"))?;
        let password = text
            .strip_suffix('\n')
            .map(|p| p.strip_suffix('\r').unwrap_or(p))
            .unwrap_or(&text);
        if password.is_empty() {
            return Err(format!("the Redis password file {shown} is empty"));
        }
        if password.contains(['\n', '\r']) {
            return Err(format!(
                "the Redis password file {shown} holds more than one line (it holds the password only)"
            ));
        }
        Ok(password.to_string())
    }

    /// The user and the password to authenticate with now.
    pub fn credentials(&self) -> Result<(Option<String>, Option<String>), RedisError> {
        let password = self
            .read()
            .map_err(|why| RedisError::new(ErrorKind::Auth, why))?;
        Ok((self.username.clone(), Some(password)))
    }
}

#[async_trait::async_trait]
impl CredentialProvider for PasswordFile {
    async fn fetch(
        &self,
        _server: Option<&Server>,
    ) -> Result<(Option<String>, Option<String>), RedisError> {
        self.credentials()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(text: &[u8]) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("password");
        std::fs::write(&path, text).expect("write");
        (dir, path)
    }

    #[test]
    fn the_password_is_the_line_without_its_newline() {
        for (text, want) in [
            (&b"s3cret\n"[..], "s3cret"),
            (b"s3cret", "s3cret"),
            (b"s3cret\r\n", "s3cret"),
            (b" spaced :@/#? \n", " spaced :@/#? "),
        ] {
            let (_dir, path) = file(text);
            let f = PasswordFile::new(&path, Some("rls".into())).expect("a password");
            assert_eq!(f.read().expect("read"), want);
            let (user, password) = f.credentials().expect("credentials");
            assert_eq!(user.as_deref(), Some("rls"));
            assert_eq!(password.as_deref(), Some(want));
        }
    }

    #[test]
    fn a_rotated_file_is_read_anew() {
        let (_dir, path) = file(b"old\n");
        let f = PasswordFile::new(&path, None).expect("a password");
        assert_eq!(f.read().expect("read"), "old");
        // as a Secret's mount swaps it: a new file renamed over the old
        let next = path.with_extension("next");
        std::fs::write(&next, b"new\n").expect("write");
        std::fs::rename(&next, &path).expect("rename");
        assert_eq!(f.read().expect("read"), "new");
    }

    #[test]
    fn bad_files_are_named_never_shown() {
        let (_dir, path) = file(b"");
        let e = PasswordFile::new(&path, None).expect_err("empty");
        assert!(e.contains("is empty") && e.contains("password"), "{e}");
        let (_dir, path) = file(b"one\ntwo\n");
        let e = PasswordFile::new(&path, None).expect_err("two lines");
        assert!(e.contains("more than one line"), "{e}");
        assert!(!e.contains("one\n") && !e.contains("two"), "{e}");
        let (_dir, path) = file(&[0xff, 0xfe]);
        assert!(PasswordFile::new(&path, None)
            .expect_err("not UTF-8")
            .contains("not UTF-8"));
        let missing = Path::new("/nonexistent/redis-password");
        let e = PasswordFile::new(missing, None).expect_err("missing");
        assert!(e.contains("/nonexistent/redis-password"), "{e}");
    }
}

//! Test certificates made with the `openssl` command: a CA, and server and
//! client certificates it signs (loopback names only).

use std::path::{Path, PathBuf};
use std::process::Command;

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("openssl is installed (apt-get install openssl)");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA named `name` in `dir`: `<name>-ca.pem` and `<name>-ca.key`.
pub struct Ca {
    pub dir: PathBuf,
    pub name: String,
}

impl Ca {
    pub fn new(dir: &Path, name: &str) -> Self {
        openssl(
            dir,
            &[
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "2",
                "-keyout",
                &format!("{name}-ca.key"),
                "-out",
                &format!("{name}-ca.pem"),
                "-subj",
                &format!("/CN={name} test CA"),
            ],
        );
        Self {
            dir: dir.to_path_buf(),
            name: name.to_string(),
        }
    }

    pub fn pem(&self) -> PathBuf {
        self.dir.join(format!("{}-ca.pem", self.name))
    }

    /// Issues `<leaf>.pem` / `<leaf>.key` for a server (localhost, 127.0.0.1) or a client.
    pub fn issue(&self, leaf: &str, server: bool) -> (PathBuf, PathBuf) {
        let ext = if server {
            "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n"
        } else {
            "extendedKeyUsage=clientAuth\n"
        };
        self.issue_with(leaf, ext, "2")
    }

    /// Issues a client certificate naming `region` as README "Several
    /// regions" says (DNS SAN `<region>.regions.test`), valid for `days`
    /// ("0": expired a second after it is made).
    pub fn issue_region(&self, leaf: &str, region: &str, days: &str) -> (PathBuf, PathBuf) {
        let ext =
            format!("subjectAltName=DNS:{region}.regions.test\nextendedKeyUsage=clientAuth\n");
        self.issue_with(leaf, &ext, days)
    }

    /// Issues `<leaf>.pem` / `<leaf>.key` with the extensions `ext`, valid
    /// for `days`.
    pub fn issue_with(&self, leaf: &str, ext: &str, days: &str) -> (PathBuf, PathBuf) {
        std::fs::write(self.dir.join(format!("{leaf}.ext")), ext).expect("ext file");
        openssl(
            &self.dir,
            &[
                "req",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-keyout",
                &format!("{leaf}.key"),
                "-out",
                &format!("{leaf}.csr"),
                "-subj",
                &format!("/CN={leaf}"),
            ],
        );
        openssl(
            &self.dir,
            &[
                "x509",
                "-req",
                "-in",
                &format!("{leaf}.csr"),
                "-CA",
                &format!("{}-ca.pem", self.name),
                "-CAkey",
                &format!("{}-ca.key", self.name),
                "-CAcreateserial",
                "-days",
                days,
                "-out",
                &format!("{leaf}.pem"),
                "-extfile",
                &format!("{leaf}.ext"),
            ],
        );
        (
            self.dir.join(format!("{leaf}.pem")),
            self.dir.join(format!("{leaf}.key")),
        )
    }
}

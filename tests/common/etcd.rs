//! A single-member etcd (Debian's `etcd-server`, installed by scripts/test.sh) that a test
//! starts on loopback ports of its own: router replicas sharing a plan (tests/router_etcd.rs)
//! and the replicas' manifest (tests/deploy_manifests.rs).

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A single-member etcd on loopback ports of its own, its data in a temporary directory.
pub struct Etcd {
    child: Option<Child>,
    dir: tempfile::TempDir,
    client: u16,
    peer: u16,
}

impl Etcd {
    pub fn start() -> Etcd {
        let mut e = Etcd {
            child: None,
            dir: tempfile::tempdir().unwrap(),
            client: free_port(),
            peer: free_port(),
        };
        e.run();
        e
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.client)
    }

    /// Start (or restart on the same data and ports) and wait until it answers.
    pub fn run(&mut self) {
        let (c, p) = (self.client, self.peer);
        let child = Command::new("etcd")
            .args([
                "--name",
                "default",
                "--data-dir",
                self.dir.path().join("data").to_str().unwrap(),
                "--listen-client-urls",
                &format!("http://127.0.0.1:{c}"),
                "--advertise-client-urls",
                &format!("http://127.0.0.1:{c}"),
                "--listen-peer-urls",
                &format!("http://127.0.0.1:{p}"),
                "--initial-advertise-peer-urls",
                &format!("http://127.0.0.1:{p}"),
                "--initial-cluster",
                &format!("default=http://127.0.0.1:{p}"),
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("etcd runs: install Debian's etcd-server (scripts/test.sh does)");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        let http = reqwest::blocking::Client::new();
        loop {
            let ok = http
                .post(format!("{}/v3/kv/range", self.url()))
                .body(r#"{"key":"AA=="}"#)
                .send()
                .is_ok_and(|r| r.status().is_success());
            if ok {
                return;
            }
            assert!(Instant::now() < deadline, "etcd did not answer within 30 s");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// SIGKILL it (its data stays for [`Etcd::run`]).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGKILL it, delete its data, and start a new, empty store on the same ports.
    pub fn wipe(&mut self) {
        self.kill();
        std::fs::remove_dir_all(self.dir.path().join("data")).unwrap();
        self.run();
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
    }
}

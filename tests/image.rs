//! The router's image (deploy/Containerfile, scripts/build-image.sh) built and run for real with
//! podman and runc (no daemon; `scripts/test.sh` installs them): built from the debug binary the
//! suite already has, it must hold nothing but the binary, its libraries and three /etc files,
//! run as UID 65532, route a completion to an emulator on the host, follow a backends file
//! swapped the way the kubelet swaps a mounted ConfigMap, drain a stream on SIGTERM and exit 0,
//! and refuse a missing backends file with one line and a non-zero exit. docs/deploy.md.

mod common;

use common::procs::{Proc, BIN};
use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const UID: &str = "65532";

/// podman as this kind of machine needs it (hybrid cgroups, a sandbox that refuses setrlimit):
/// vfs storage, runc, cgroupfs, no default ulimits (a containers.conf of our own).
struct Podman {
    conf: tempfile::TempDir,
    image: String,
    containers: Vec<String>,
}

impl Podman {
    fn new() -> Podman {
        let runs = |bin: &str| {
            Command::new(bin)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        };
        assert!(
            runs("podman") && runs("runc"),
            "podman and runc are needed: run the suite through scripts/test.sh, or `apt-get install --no-install-recommends podman runc`"
        );
        let conf = tempfile::tempdir().expect("tempdir");
        std::fs::write(
            conf.path().join("containers.conf"),
            "[containers]\ndefault_ulimits = []\n",
        )
        .expect("containers.conf");
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos();
        Podman {
            conf,
            image: format!("localhost/cacheroute-test:{}-{nanos}", std::process::id()),
            containers: Vec::new(),
        }
    }

    /// The global flags (joined, they are scripts/build-image.sh's PODMAN).
    fn global() -> [&'static str; 6] {
        [
            "--storage-driver",
            "vfs",
            "--runtime",
            "runc",
            "--cgroup-manager",
            "cgroupfs",
        ]
    }

    fn cmd(&self) -> Command {
        let mut c = Command::new("podman");
        c.args(Self::global())
            .env("CONTAINERS_CONF", self.conf.path().join("containers.conf"));
        c
    }

    fn output(&self, args: &[&str]) -> Output {
        self.cmd().args(args).output().expect("podman runs")
    }

    /// `podman ARGS` that must succeed; its stdout.
    fn ok(&self, args: &[&str]) -> String {
        let o = self.output(args);
        assert!(
            o.status.success(),
            "podman {args:?} failed: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).trim().to_string()
    }

    /// A container name of this test, removed when the test ends.
    fn name(&mut self, what: &str) -> String {
        let n = format!("cacheroute-test-{what}-{}", std::process::id());
        let _ = self.output(&["rm", "-f", &n]);
        self.containers.push(n.clone());
        n
    }
}

impl Drop for Podman {
    fn drop(&mut self) {
        for c in &self.containers {
            let _ = self.output(&["rm", "-f", "-t", "0", c]);
        }
        let _ = self.output(&["rmi", "-f", &self.image]);
    }
}

/// A directory laid out as the kubelet mounts a ConfigMap: the data in a timestamped directory,
/// `..data` a symlink to it, `backends` a symlink to `..data/backends`; a new version is a new
/// directory and `..data` renamed over.
struct ConfigMapDir {
    dir: tempfile::TempDir,
    version: u32,
}

impl ConfigMapDir {
    fn new(backends: &str) -> ConfigMapDir {
        let dir = tempfile::tempdir().expect("tempdir");
        // Readable by the container's user, as the kubelet's default mode 0644 is.
        set_mode(dir.path(), 0o755);
        std::os::unix::fs::symlink("..data/backends", dir.path().join("backends")).unwrap();
        let mut d = ConfigMapDir { dir, version: 0 };
        d.write(backends);
        d
    }

    fn write(&mut self, backends: &str) {
        self.version += 1;
        let root = self.dir.path();
        let old = std::fs::read_link(root.join("..data")).ok();
        let v = format!("..2026_12_03_00_00_00.{:09}", self.version);
        std::fs::create_dir(root.join(&v)).unwrap();
        set_mode(&root.join(&v), 0o755);
        std::fs::write(root.join(&v).join("backends"), backends).unwrap();
        set_mode(&root.join(&v).join("backends"), 0o644);
        std::os::unix::fs::symlink(&v, root.join("..data_tmp")).unwrap();
        std::fs::rename(root.join("..data_tmp"), root.join("..data")).unwrap();
        if let Some(old) = old {
            std::fs::remove_dir_all(root.join(old)).unwrap();
        }
    }
}

fn set_mode(p: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// Requests an emulator has finished (its `vllm:request_success_total` lines summed).
fn served(emulator: &Proc) -> f64 {
    let text = reqwest::blocking::get(format!("{}/metrics", emulator.url))
        .and_then(|r| r.text())
        .expect("emulator /metrics");
    text.lines()
        .filter(|l| l.starts_with("vllm:request_success_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// One completion through the router: (status, x-cacheroute-destination, body).
fn complete(router: &str, max_tokens: u32) -> (u16, String, String) {
    let r = reqwest::blocking::Client::new()
        .post(format!("{router}/v1/completions"))
        .header("content-type", "application/json")
        .body(format!(
            r#"{{"model":"m","prompt":"a prompt for the image test","max_tokens":{max_tokens}}}"#
        ))
        .timeout(Duration::from_secs(30))
        .send()
        .expect("the router answers");
    let dest = r
        .headers()
        .get("x-cacheroute-destination")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    (r.status().as_u16(), dest, r.text().unwrap_or_default())
}

/// The router in its container: `podman run` attached (its child, its URL, the container's name
/// and its stderr read to the end by a thread).
type Router = (Child, String, String, std::thread::JoinHandle<String>);

/// Start the router in its container and read its `listening on` line.
fn start_router(p: &mut Podman, config: &Path) -> Router {
    let name = p.name("router");
    let mount = format!("{}:/etc/cacheroute:ro", config.display());
    let mut child = p
        .cmd()
        .args(["run", "--rm", "--name", &name, "--network", "host"])
        .args(["-v", &mount, &p.image])
        .args(["route", "--listen", "127.0.0.1:0"])
        .args(["--backends-file", "/etc/cacheroute/backends"])
        .args(["--policy", "cacheroute", "--health-interval-ms", "200"])
        .args(["--workers", "1", "--drain-timeout-s", "60"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("podman run starts");
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut lines = BufReader::new(stdout).lines();
        let _ = tx.send(lines.next().and_then(Result::ok));
        for _ in lines {}
    });
    let mut stderr = child.stderr.take().unwrap();
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(Some(l)) if l.starts_with("listening on ") => {
            let url = l["listening on ".len()..].trim().to_string();
            (child, url, name, err)
        }
        other => {
            let _ = child.kill();
            let _ = child.wait();
            let err = err.join().unwrap_or_default();
            panic!("the router in its container did not start ({other:?}): {err}");
        }
    }
}

/// Wait (up to 60 s) until `f` holds.
fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !f() {
        assert!(Instant::now() < deadline, "{what}: not within 60 s");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn the_image_routes_to_the_host_runs_as_non_root_and_drains_on_sigterm() {
    let mut p = Podman::new();
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR"));

    // Built by the script a user runs, from the debug binary the suite already has.
    let build = Command::new("bash")
        .arg(repo.join("scripts/build-image.sh"))
        .arg(BIN)
        .env("IMAGE", &p.image)
        .env("PODMAN", format!("podman {}", Podman::global().join(" ")))
        .env("CONTAINERS_CONF", p.conf.path().join("containers.conf"))
        .output()
        .expect("scripts/build-image.sh runs");
    assert!(
        build.status.success(),
        "scripts/build-image.sh failed: {}",
        String::from_utf8_lossy(&build.stderr)
    );
    let size: u64 = p
        .ok(&["image", "inspect", "--format", "{{.Size}}", &p.image])
        .parse()
        .unwrap();
    let bin_size = std::fs::metadata(BIN).unwrap().len();
    println!(
        "image size: {size} bytes ({:.1} MB) from the debug binary of {bin_size} bytes",
        size as f64 / 1e6
    );

    // Non-root by number in the image's configuration.
    let user = p.ok(&["image", "inspect", "--format", "{{.Config.User}}", &p.image]);
    assert_eq!(user, format!("{UID}:{UID}"), "the image's USER");

    // Nothing but the binary, the files ldd names (the loader, libc, libm, libgcc_s) and /etc's
    // passwd, group and nsswitch.conf.
    let ldd = Command::new("ldd").arg(BIN).output().expect("ldd runs");
    let mut allowed: BTreeSet<String> = String::from_utf8_lossy(&ldd.stdout)
        .split_whitespace()
        .filter(|w| w.starts_with('/'))
        .map(|w| w.trim_start_matches('/').to_string())
        .collect();
    for f in [
        "usr/local/bin/cacheroute",
        "etc/passwd",
        "etc/group",
        "etc/nsswitch.conf",
    ] {
        allowed.insert(f.to_string());
    }
    let probe = p.name("files");
    p.ok(&["create", "--name", &probe, &p.image]);
    let tar = p
        .cmd()
        .args(["export", &probe])
        .output()
        .expect("podman export");
    assert!(tar.status.success(), "podman export failed");
    let mut list = Command::new("tar")
        .args(["-t", "-v"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("tar runs");
    let mut stdin = list.stdin.take().unwrap();
    let body = tar.stdout;
    let feeder = std::thread::spawn(move || {
        use std::io::Write;
        let _ = stdin.write_all(&body);
    });
    let listing = list.wait_with_output().expect("tar lists");
    feeder.join().unwrap();
    let mut files = BTreeSet::new();
    for l in String::from_utf8_lossy(&listing.stdout).lines() {
        if l.starts_with('d') {
            continue;
        }
        let path = l.split_whitespace().last().unwrap().to_string();
        assert!(
            allowed.contains(&path),
            "the image holds {path} ({l}); only the binary, its libraries and /etc's three files belong there: {allowed:?}"
        );
        files.insert(path);
    }
    assert!(
        files.contains("usr/local/bin/cacheroute"),
        "no binary in the image: {files:?}"
    );

    // The router in the container, the emulators on the host; its backends from a file in a
    // directory laid out as a mounted ConfigMap.
    // Slow (a tenth of the tiny CPU engine's speed), so that a 300-token stream is still running
    // when the router is told to stop.
    let a = Proc::emulator_scaled("127.0.0.1:0", "0.1");
    let b = Proc::emulator_scaled("127.0.0.1:0", "0.1");
    let mut config = ConfigMapDir::new(&format!("# the first version\n{}\n", a.url));
    let (mut router, url, name, router_err) = start_router(&mut p, config.dir.path());
    let http = reqwest::blocking::Client::new();
    eventually("the router's /health answers 200", || {
        http.get(format!("{url}/health"))
            .send()
            .is_ok_and(|r| r.status() == 200)
    });

    // A real completion, served by the emulator on the host.
    let before = served(&a);
    let (status, dest, body) = complete(&url, 5);
    assert_eq!(status, 200, "a completion through the image: {body}");
    assert_eq!(dest, "0", "served by the first backend's slot");
    let v: serde_json::Value = serde_json::from_str(&body).expect("a JSON completion");
    assert_eq!(v["usage"]["completion_tokens"], 5, "{body}");
    assert_eq!(
        served(&a),
        before + 1.0,
        "the emulator on the host served it"
    );

    // Its process runs as 65532, not root (no user namespace: the host sees the same IDs).
    let pid = p.ok(&["inspect", "--format", "{{.State.Pid}}", &name]);
    let status_file = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let uids = status_file
        .lines()
        .find(|l| l.starts_with("Uid:"))
        .unwrap()
        .to_string();
    let ids: Vec<&str> = uids.split_whitespace().skip(1).collect();
    assert_eq!(
        ids, [UID; 4],
        "the router's real, effective, saved and fs UIDs: {uids}"
    );

    // The kubelet's swap of a mounted ConfigMap: the router follows it inside the container.
    config.write(&format!("{}\n", b.url));
    eventually("requests go to the backend of the new file", || {
        let (status, dest, _) = complete(&url, 1);
        status == 200 && dest == "1"
    });
    // From then on, the old backend gets nothing.
    let a_before = served(&a);
    let b_served = served(&b);
    assert!(b_served >= 1.0, "the new backend served none");
    let (status, _, body) = complete(&url, 1);
    assert_eq!(status, 200, "{body}");
    assert_eq!(served(&a), a_before, "the removed backend got requests");
    assert_eq!(served(&b), b_served + 1.0, "the new backend did not serve");

    // SIGTERM (podman stop) mid-stream: the stream runs to its end, the router exits 0.
    const TOKENS: usize = 300;
    let (started_tx, started_rx) = std::sync::mpsc::channel();
    let stream_url = url.clone();
    let stream = std::thread::spawn(move || {
        let mut r = reqwest::blocking::Client::new()
            .post(format!("{stream_url}/v1/completions"))
            .header("content-type", "application/json")
            .body(format!(
                r#"{{"model":"m","prompt":"a long stream","max_tokens":{TOKENS},"stream":true}}"#
            ))
            .timeout(Duration::from_secs(120))
            .send()
            .expect("the stream starts");
        let mut first = [0u8; 1];
        r.read_exact(&mut first).expect("the stream's first byte");
        started_tx.send(()).unwrap();
        let mut rest = String::from_utf8_lossy(&first).into_owned();
        let read = r.read_to_string(&mut rest);
        (read.map_err(|e| e.to_string()), rest)
    });
    started_rx
        .recv_timeout(Duration::from_secs(60))
        .expect("the stream began");
    p.ok(&["stop", "--time", "90", &name]);
    let exit = router.wait().expect("podman run ends");
    let err = router_err.join().unwrap();
    let (read, rest) = stream.join().unwrap();
    assert!(
        read.is_ok(),
        "the stream was cut: {read:?}; router stderr: {err}"
    );
    let events = rest.matches("data: ").count();
    assert!(
        rest.ends_with("data: [DONE]\n\n") && events == TOKENS + 1,
        "the stream ended early ({events} events of {}): …{}",
        TOKENS + 1,
        &rest[rest.len().saturating_sub(200)..]
    );
    assert_eq!(
        exit.code(),
        Some(0),
        "the router's exit after SIGTERM; stderr: {err}"
    );
    assert!(
        err.contains("drained; stopped"),
        "no drain in the router's log: {err}"
    );

    // A backends file that is not there (a ConfigMap not mounted): one line naming it, a failed
    // start.
    let o = p.output(&[
        "run",
        "--rm",
        "--network",
        "host",
        &p.image,
        "route",
        "--listen",
        "127.0.0.1:0",
        "--backends-file",
        "/etc/cacheroute/backends",
        "--policy",
        "cacheroute",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    let errors: Vec<&str> = err.lines().filter(|l| l.contains("error")).collect();
    assert!(
        !o.status.success() && errors.len() == 1 && errors[0].contains("/etc/cacheroute/backends"),
        "a missing backends file in the container: exit {:?}, stderr: {err}",
        o.status.code()
    );
}

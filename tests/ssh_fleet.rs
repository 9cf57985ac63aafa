//! The SSH path against a real `sshd` on 127.0.0.1: this test starts its own daemon on a free
//! port with generated host and user keys (never touching a system sshd), gives its sessions a
//! fake `nvidia-smi` reporting two H100s, and runs the fleet preflight over it — a good host,
//! a wrong GPU count, a refused key and a busy port each give the expected answer.

use cacheroute::fleet::inventory::Inventory;
use cacheroute::fleet::ssh::{preflight, Remote, SshError};
use std::path::Path;
use std::process::{Child, Command, Stdio};

struct Sshd {
    child: Child,
    port: u16,
    dir: tempfile::TempDir,
}

impl Drop for Sshd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn keygen(path: &Path) {
    let st = Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-f"])
        .arg(path)
        .status()
        .unwrap();
    assert!(st.success());
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn start_sshd() -> Sshd {
    let sshd = Path::new("/usr/sbin/sshd");
    if !sshd.exists() {
        // scripts/test.sh installs openssh-server; without it this test cannot mean anything.
        panic!("/usr/sbin/sshd is missing: run the suite through scripts/test.sh (it installs openssh-server)");
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    keygen(&d.join("host_key"));
    keygen(&d.join("user_key"));
    keygen(&d.join("stranger_key"));
    std::fs::copy(d.join("user_key.pub"), d.join("authorized_keys")).unwrap();
    let bin = d.join("bin");
    std::fs::create_dir(&bin).unwrap();
    let smi = bin.join("nvidia-smi");
    std::fs::write(
        &smi,
        "#!/bin/sh\necho 'NVIDIA H100 80GB HBM3'\necho 'NVIDIA H100 80GB HBM3'\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&smi, std::fs::Permissions::from_mode(0o755)).unwrap();
    let port = free_port();
    let cfg = format!(
        "ListenAddress 127.0.0.1\nPort {port}\nHostKey {hk}\nPidFile {d}/sshd.pid\nAuthorizedKeysFile {d}/authorized_keys\n\
PermitRootLogin prohibit-password\nPubkeyAuthentication yes\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n\
UsePAM no\nStrictModes no\nSetEnv PATH={bin}:/usr/local/bin:/usr/bin:/bin\n",
        hk = d.join("host_key").display(),
        d = d.display(),
        bin = bin.display()
    );
    std::fs::write(d.join("sshd_config"), cfg).unwrap();
    std::fs::create_dir_all("/run/sshd").unwrap();
    let mut child = Command::new(sshd)
        .args(["-D", "-e", "-f"])
        .arg(d.join("sshd_config"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    for _ in 0..100 {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Sshd { child, port, dir };
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    panic!("sshd did not start on port {port}");
}

fn inventory(s: &Sshd, key: &str, gpus: u32) -> Inventory {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/inventories/local-ssh.yaml"
    ))
    .unwrap();
    let mut inv = Inventory::parse(&text, "local-ssh.yaml").unwrap();
    let h = &mut inv.hosts[0];
    h.port = s.port;
    h.identity = Some(s.dir.path().join(key));
    h.gpus.count = gpus;
    h.scratch = s.dir.path().join("scratch");
    inv
}

#[test]
fn preflight_over_a_real_sshd() {
    let s = start_sshd();
    // A good host.
    let inv = inventory(&s, "user_key", 2);
    let r = Remote::new(&inv, &inv.hosts[0]);
    let rep = preflight(&r, &[free_port()]).unwrap();
    assert_eq!(rep.gpus, vec!["NVIDIA H100 80GB HBM3".to_string(); 2]);
    assert!(rep.free_disk_mib.unwrap_or(0) > 0);
    assert!(
        s.dir.path().join("scratch").is_dir(),
        "scratch created on the host"
    );
    // The inventory expects more GPUs than the host has.
    let inv4 = inventory(&s, "user_key", 4);
    let e = preflight(&Remote::new(&inv4, &inv4.hosts[0]), &[])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("host localhost")
            && e.contains("reports 2 GPU(s) but the inventory says 4")
            && e.contains("gpus.count"),
        "{e}"
    );
    // A key the host does not accept.
    let bad = inventory(&s, "stranger_key", 2);
    let e = preflight(&Remote::new(&bad, &bad.hosts[0]), &[]).unwrap_err();
    assert!(matches!(e, SshError::Auth { .. }), "{e}");
    let e = e.to_string();
    assert!(
        e.contains("host localhost") && e.contains("identity:"),
        "{e}"
    );
    assert!(!e.contains("BEGIN OPENSSH"), "no secret in messages");
    // An engine port already taken.
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let p = busy.local_addr().unwrap().port();
    let e = preflight(&r, &[p]).unwrap_err().to_string();
    assert!(e.contains(&format!("port(s) {p} already in use")), "{e}");
    // The same through the CLI: one line per host, non-zero exit when one fails.
    let f = s.dir.path().join("inv.yaml");
    std::fs::write(&f, yaml_serde::to_string(&inv).unwrap()).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_cacheroute"))
        .args(["fleet", "preflight", "--inventory"])
        .arg(&f)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        String::from_utf8_lossy(&o.stdout).starts_with("localhost: ok — 2 × NVIDIA H100 80GB HBM3")
    );
    std::fs::write(&f, yaml_serde::to_string(&inv4).unwrap()).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_cacheroute"))
        .args(["fleet", "preflight", "--inventory"])
        .arg(&f)
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr)
        .starts_with("error: host localhost: nvidia-smi reports 2 GPU(s)"));
    // Nothing listening: a clear connect error.
    let mut gone = inventory(&s, "user_key", 2);
    gone.hosts[0].port = free_port();
    let e = preflight(&Remote::new(&gone, &gone.hosts[0]), &[])
        .unwrap_err()
        .to_string();
    assert!(e.contains("cannot connect") && e.contains("port:"), "{e}");
}

//! Test hosts in network namespaces: each host is a namespace with its own address on a
//! point-to-point veth link to the test's namespace (host i: 10.231.<i+1>.2, the test's end
//! 10.231.<i+1>.1, one subnet per host), and its own `sshd` on port 22 of that address, with
//! host keys and an authorized user key generated in a temporary directory. Everything a
//! session starts there runs in that namespace, so cutting a host's link (`cut`) really cuts
//! it off. Needs root, `ip` and `/usr/sbin/sshd`.
//!
//! [`Hosts`] removes its namespaces, links and every process in them when dropped; at start it
//! removes what a killed earlier run left under the same prefix.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// One host.
pub struct Host {
    /// Namespace name.
    pub ns: String,
    /// The host's address (its sshd listens on port 22 there).
    pub address: String,
    /// The test's end of the host's link; `ip link set … down` cuts the host off.
    pub link: String,
    /// Files of this host (sshd config, host key, fake tools, scratch).
    pub dir: PathBuf,
    sshd: Child,
}

/// Hosts made by a test; all removed on drop.
pub struct Hosts {
    pub hosts: Vec<Host>,
    /// Holds `user_key` (authorized on every host).
    pub dir: tempfile::TempDir,
    prefix: String,
}

fn ip(args: &[&str]) -> Output {
    Command::new("ip").args(args).output().expect("running ip")
}

fn ip_ok(args: &[&str]) {
    let o = ip(args);
    assert!(
        o.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&o.stderr)
    );
}

fn keygen(path: &Path) {
    let st = Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-f"])
        .arg(path)
        .status()
        .expect("ssh-keygen");
    assert!(st.success());
}

/// PIDs of every process in namespace `ns`.
pub fn pids_in(ns: &str) -> Vec<u32> {
    String::from_utf8_lossy(&ip(&["netns", "pids", ns]).stdout)
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// The command line of process `pid` (empty when it is gone).
pub fn cmdline(pid: u32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
        .unwrap_or_default()
}

/// Remove namespaces named `prefix…` and their links: SIGKILL everything in them first.
pub fn remove_stale(prefix: &str) {
    let list = String::from_utf8_lossy(&ip(&["netns", "list"]).stdout).into_owned();
    for ns in list
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with(prefix))
    {
        for p in pids_in(ns) {
            // SAFETY: signalling a process by PID.
            unsafe {
                libc::kill(p as libc::pid_t, libc::SIGKILL);
            }
        }
        let _ = ip(&["netns", "del", ns]);
    }
    let links = String::from_utf8_lossy(&ip(&["-o", "link", "show"]).stdout).into_owned();
    for l in links.lines() {
        if let Some(name) = l.split(": ").nth(1) {
            let name = name.split('@').next().unwrap_or(name);
            if name.starts_with(prefix) {
                let _ = ip(&["link", "del", name]);
            }
        }
    }
}

impl Hosts {
    /// `gpus.len()` hosts named `<prefix>0`, `<prefix>1`, …; host i's fake `nvidia-smi`
    /// reports `gpus[i]` GPUs named `model`. Sessions get `extra_path` (e.g. the directory of
    /// the `cacheroute` binary) on their PATH.
    pub fn new(prefix: &str, gpus: &[u32], model: &str, extra_path: &Path) -> Hosts {
        assert!(
            Path::new("/usr/sbin/sshd").exists(),
            "/usr/sbin/sshd is missing: run the suite through scripts/test.sh (it installs openssh-server)"
        );
        remove_stale(prefix);
        std::fs::create_dir_all("/run/sshd").unwrap();
        let dir = tempfile::tempdir().unwrap();
        keygen(&dir.path().join("user_key"));
        let mut hosts = Hosts {
            hosts: Vec::new(),
            dir,
            prefix: prefix.to_string(),
        };
        for (i, &count) in gpus.iter().enumerate() {
            let h = hosts.make_host(i, count, model, extra_path);
            hosts.hosts.push(h);
        }
        for h in &hosts.hosts {
            wait_listening(&h.address);
        }
        hosts
    }

    fn make_host(&self, i: usize, gpus: u32, model: &str, extra_path: &Path) -> Host {
        let ns = format!("{}{i}", self.prefix);
        let link = format!("{}{i}r", self.prefix);
        let peer = format!("{}{i}n", self.prefix);
        let net = format!("10.231.{}", i + 1);
        let address = format!("{net}.2");
        ip_ok(&["netns", "add", &ns]);
        ip_ok(&["link", "add", &link, "type", "veth", "peer", "name", &peer]);
        ip_ok(&["link", "set", &peer, "netns", &ns]);
        ip_ok(&["-n", &ns, "link", "set", &peer, "name", "eth0"]);
        ip_ok(&["addr", "add", &format!("{net}.1/24"), "dev", &link]);
        ip_ok(&["link", "set", &link, "up"]);
        ip_ok(&[
            "-n",
            &ns,
            "addr",
            "add",
            &format!("{address}/24"),
            "dev",
            "eth0",
        ]);
        ip_ok(&["-n", &ns, "link", "set", "eth0", "up"]);
        ip_ok(&["-n", &ns, "link", "set", "lo", "up"]);
        ip_ok(&[
            "-n",
            &ns,
            "route",
            "add",
            "default",
            "via",
            &format!("{net}.1"),
        ]);

        let d = self.dir.path().join(format!("host{i}"));
        let bin = d.join("bin");
        std::fs::create_dir_all(&bin).unwrap();
        keygen(&d.join("host_key"));
        std::fs::copy(
            self.dir.path().join("user_key.pub"),
            d.join("authorized_keys"),
        )
        .unwrap();
        let names = format!("  echo '{model}'\n").repeat(gpus as usize);
        let smi = bin.join("nvidia-smi");
        std::fs::write(
            &smi,
            format!(
                "#!/bin/sh\ncase \"$*\" in\n*utilization.gpu*) exit 0;;\n*)\n{names}  ;;\nesac\n"
            ),
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&smi, std::fs::Permissions::from_mode(0o755)).unwrap();
        let cfg = format!(
            "ListenAddress {address}\nPort 22\nHostKey {d}/host_key\nPidFile {d}/sshd.pid\nAuthorizedKeysFile {d}/authorized_keys\n\
PermitRootLogin prohibit-password\nPubkeyAuthentication yes\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n\
UsePAM no\nStrictModes no\nMaxSessions 64\nMaxStartups 64\nSetEnv PATH={bin}:{extra}:/usr/local/bin:/usr/bin:/bin\n",
            d = d.display(),
            bin = bin.display(),
            extra = extra_path.display(),
        );
        std::fs::write(d.join("sshd_config"), cfg).unwrap();
        let sshd = Command::new("ip")
            .args(["netns", "exec", &ns, "/usr/sbin/sshd", "-D", "-e", "-f"])
            .arg(d.join("sshd_config"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting sshd in its namespace");
        Host {
            ns,
            address,
            link,
            dir: d,
            sshd,
        }
    }

    /// The user key every host authorizes.
    pub fn user_key(&self) -> PathBuf {
        self.dir.path().join("user_key")
    }

    /// Cut host `i` off the network (its link down).
    pub fn cut(&self, i: usize) {
        ip_ok(&["link", "set", &self.hosts[i].link, "down"]);
    }

    /// Bring host `i`'s link back (and its address: a link set down loses its route).
    pub fn restore(&self, i: usize) {
        ip_ok(&["link", "set", &self.hosts[i].link, "up"]);
        wait_listening(&self.hosts[i].address);
    }

    /// Processes in any host's namespace whose command line contains `pattern`.
    pub fn processes_matching(&self, pattern: &str) -> Vec<String> {
        self.hosts
            .iter()
            .flat_map(|h| {
                pids_in(&h.ns)
                    .into_iter()
                    .map(|p| (h.ns.clone(), p, cmdline(p)))
                    .filter(|(_, _, c)| c.contains(pattern))
                    .map(|(ns, p, c)| format!("{ns}: {p} {c}"))
                    .collect::<Vec<_>>()
            })
            .collect()
    }
}

/// Wait (up to 20 s) until something accepts on `address:22`.
fn wait_listening(address: &str) {
    let t0 = Instant::now();
    let addr: std::net::SocketAddr = format!("{address}:22").parse().unwrap();
    while std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(500)).is_err() {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "sshd on {address}:22 did not answer"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for h in &mut self.hosts {
            let _ = h.sshd.kill();
            let _ = h.sshd.wait();
        }
        remove_stale(&self.prefix);
    }
}

//! deploy/kubernetes/ checked offline: every manifest against Kubernetes' own schemas with
//! `kubernetes-validate` (strict: unknown fields refused; a kind without a schema refused too),
//! broken copies refused the same way, and the router's Deployment against the image and the
//! router itself (its user, its backends file on the ConfigMap's mount, its drain inside the
//! grace period, its arguments accepted by the real binary). docs/deploy.md.

mod common;

use common::procs::Proc;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

const VALIDATE: &str = "tools/kubernetes-validate-1.37.0";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The cached `kubernetes-validate` (`scripts/test.sh` installs it): a clear failure, never a
/// skip, when it is missing.
fn validator() -> PathBuf {
    let dir = cacheroute::experiment::engines::engine_cache_dir().join(VALIDATE);
    assert!(
        dir.join(".complete").exists(),
        "{} is missing: run the suite through scripts/test.sh, which installs kubernetes-validate 1.37.0 there",
        dir.display()
    );
    dir.join("venv/bin/kubernetes-validate")
}

/// The YAML documents of a file (`---` between them; a document of comments alone skipped).
fn documents(text: &str) -> Vec<Value> {
    text.split("\n---\n")
        .map(|d| yaml_serde::from_str::<Value>(d).expect("YAML"))
        .filter(|v| !v.is_null())
        .collect()
}

/// `kubernetes-validate --strict FILE`: Ok when it passed every document of the file and said
/// nothing else (it passes a kind it has no schema for with only a warning); else its words.
fn validate(file: &Path) -> Result<(), String> {
    let n = documents(&std::fs::read_to_string(file).unwrap()).len();
    let o = Command::new(validator())
        .arg("--strict")
        .arg(file)
        .output()
        .expect("kubernetes-validate runs");
    let out = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    let passed = out.matches(" passed for resource ").count();
    let other = out
        .lines()
        .any(|l| !l.trim().is_empty() && !l.contains(" passed for resource "));
    if o.status.success() && passed == n && n > 0 && !other {
        Ok(())
    } else {
        Err(format!(
            "{}: exit {:?}, {passed} of {n} documents passed: {out}",
            file.display(),
            o.status.code()
        ))
    }
}

fn manifests() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(repo().join("deploy/kubernetes"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    v.sort();
    v
}

/// Every object of deploy/kubernetes/: (file name, object).
fn objects() -> Vec<(String, Value)> {
    manifests()
        .iter()
        .flat_map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            documents(&std::fs::read_to_string(p).unwrap())
                .into_iter()
                .map(move |d| (name.clone(), d))
        })
        .collect()
}

fn object(kind: &str, name: &str) -> Value {
    objects()
        .into_iter()
        .map(|(_, o)| o)
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("deploy/kubernetes/ has no {kind} {name}"))
}

#[test]
fn every_manifest_passes_kubernetes_schemas() {
    let files = manifests();
    assert!(!files.is_empty(), "no manifests in deploy/kubernetes/");
    let failures: Vec<String> = files.iter().filter_map(|f| validate(f).err()).collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // What docs/deploy.md promises is there.
    for (kind, name) in [
        ("Deployment", "cacheroute"),
        ("Service", "cacheroute"),
        ("ConfigMap", "cacheroute-backends"),
        ("Deployment", "vllm"),
        ("Service", "vllm"),
        ("NetworkPolicy", "vllm-from-cacheroute"),
    ] {
        object(kind, name);
    }
    assert_eq!(
        object("Service", "vllm")["spec"]["clusterIP"],
        "None",
        "vllm's Service must be headless: a virtual IP would load-balance the router's choice away"
    );
}

#[test]
fn a_broken_manifest_fails_validation() {
    let good = std::fs::read_to_string(repo().join("deploy/kubernetes/router.yaml")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let ok = dir.path().join("router.yaml");
    std::fs::write(&ok, &good).unwrap();
    validate(&ok).expect("the copy as it is passes");
    for (what, from, to) in [
        (
            "a port that is not a number",
            "containerPort: 8080",
            "containerPort: eighty",
        ),
        ("a misspelt field", "  replicas: 1", "  replica: 1"),
        (
            "a kind without a schema",
            "kind: Deployment",
            "kind: Deploymnet",
        ),
        (
            "a required field gone",
            "          image: ",
            "          imag: ",
        ),
    ] {
        assert!(good.contains(from), "router.yaml has no `{from}`");
        let bad = dir.path().join("broken.yaml");
        std::fs::write(&bad, good.replacen(from, to, 1)).unwrap();
        let r = validate(&bad);
        assert!(r.is_err(), "{what} passed validation");
        println!("{what}: {}", r.unwrap_err().trim());
    }
}

/// The router's container in its Deployment.
fn router_container() -> Value {
    object("Deployment", "cacheroute")["spec"]["template"]["spec"]["containers"][0].clone()
}

/// The value of `FLAG=value` among a container's arguments.
fn arg(args: &[String], flag: &str) -> String {
    args.iter()
        .find_map(|a| a.strip_prefix(&format!("{flag}=")))
        .unwrap_or_else(|| panic!("the router's args have no {flag}=…: {args:?}"))
        .to_string()
}

#[test]
fn the_router_manifest_agrees_with_the_image_and_the_router() {
    let d = object("Deployment", "cacheroute");
    let pod = &d["spec"]["template"]["spec"];
    let c = router_container();
    let args: Vec<String> = c["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_string())
        .collect();

    // The user the image runs as (deploy/Containerfile's USER).
    let containerfile = std::fs::read_to_string(repo().join("deploy/Containerfile")).unwrap();
    let user = containerfile
        .lines()
        .find_map(|l| l.strip_prefix("USER "))
        .expect("the Containerfile names a USER");
    let uid = user.split(':').next().unwrap().trim();
    assert_eq!(pod["securityContext"]["runAsUser"].to_string(), uid);
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);

    // The backends file is a key of the ConfigMap, mounted as a directory (never subPath: a
    // subPath mount is not updated).
    let file = PathBuf::from(arg(&args, "--backends-file"));
    let mount = c["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| Path::new(m["mountPath"].as_str().unwrap()) == file.parent().unwrap())
        .unwrap_or_else(|| panic!("no volume mounted at {}", file.parent().unwrap().display()));
    assert!(
        mount["subPath"].is_null(),
        "the backends mount uses subPath"
    );
    let volume = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .expect("the mounted volume");
    let cm = object("ConfigMap", volume["configMap"]["name"].as_str().unwrap());
    let key = file.file_name().unwrap().to_str().unwrap();
    let backends = cm["data"][key]
        .as_str()
        .unwrap_or_else(|| panic!("the ConfigMap has no key {key}"));

    // The drain and the preStop pause end before the kubelet's SIGKILL.
    let drain: f64 = arg(&args, "--drain-timeout-s").parse().unwrap();
    let pause = c["lifecycle"]["preStop"]["sleep"]["seconds"]
        .as_f64()
        .unwrap_or(0.0);
    let grace = pod["terminationGracePeriodSeconds"]
        .as_f64()
        .unwrap_or(30.0);
    assert!(
        drain + pause < grace,
        "drain {drain} s + preStop {pause} s must end before terminationGracePeriodSeconds {grace}"
    );

    // Probes and the Service on the port the router listens on.
    let listen = arg(&args, "--listen");
    let port = listen.rsplit(':').next().unwrap();
    assert_eq!(c["ports"][0]["containerPort"].to_string(), port);
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/health");
    let probe_port = &c["readinessProbe"]["httpGet"]["port"];
    assert!(
        probe_port == &c["ports"][0]["name"]
            || probe_port.as_u64().map(|p| p.to_string()).as_deref() == Some(port),
        "the readiness probe is not on the router's port"
    );

    // The real router accepts these arguments and the ConfigMap's example file, its hosts moved
    // onto loopback (this machine reaches nothing else): it starts, listens and answers /health
    // (503: nothing answers at those addresses).
    let dir = tempfile::tempdir().unwrap();
    let local = dir.path().join(key);
    std::fs::write(&local, on_loopback(backends)).unwrap();
    let local = local.to_str().unwrap().to_string();
    let run: Vec<String> = args
        .iter()
        .map(|a| {
            if a.starts_with("--listen=") {
                "--listen=127.0.0.1:0".to_string()
            } else if a.starts_with("--backends-file=") {
                format!("--backends-file={local}")
            } else {
                a.clone()
            }
        })
        .collect();
    let refs: Vec<&str> = run.iter().map(String::as_str).collect();
    let router = Proc::start(&refs);
    // Destinations start up and the first failed probe marks each down, so /health turns 503
    // once every first probe has failed (a health interval and a connect refused); it must do
    // so well within the readiness probe's period.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    let mut seen = Vec::new();
    loop {
        let health = reqwest::blocking::get(format!("{}/health", router.url)).expect("/health");
        let status = health.status().as_u16();
        seen.push(status);
        if status == 503 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "/health with no backend up never answered 503 in 15 s (answers: {seen:?})"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// A backends file with each URL's host replaced by 127.0.0.N (N = 1, 2, … by line), comments
/// and blank lines kept.
fn on_loopback(backends: &str) -> String {
    let mut n = 0;
    backends
        .lines()
        .map(|l| {
            let (url, comment) = l.split_once('#').unwrap_or((l, ""));
            let Some((scheme, rest)) = url.trim().split_once("://") else {
                return l.to_string();
            };
            n += 1;
            let port = rest.find([':', '/']).map_or("", |i| &rest[i..]);
            let hash = if comment.is_empty() { "" } else { " #" };
            format!("{scheme}://127.0.0.{n}{port}{hash}{comment}")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

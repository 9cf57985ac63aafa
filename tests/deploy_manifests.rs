//! deploy/kubernetes/ checked offline: every manifest of a built-in kind against Kubernetes' own
//! schemas with `kubernetes-validate` (strict: unknown fields refused; a kind without a schema
//! refused too), broken copies refused the same way, and the router's Deployment against the
//! image and the router itself (its user, its backends file on the ConfigMap's mount, its drain
//! inside the grace period, its arguments accepted by the real binary). The Gateway API and
//! Inference Extension kinds (no schema in Kubernetes') are checked by shape: their names and
//! ports against the EPP's and vLLM's. The variants in subdirectories (`dns/`, `replicas/`,
//! `epp/`) are started with their arguments too, against a dnsmasq and an etcd the test starts.
//! docs/deploy.md.

mod common;

use common::dnsmasq::{hosts, Dnsmasq};
use common::etcd::Etcd;
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

/// The YAML files of one directory of deploy/kubernetes/ (`""`: the top one).
fn manifests_in(dir: &str) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(repo().join("deploy/kubernetes").join(dir))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    v.sort();
    v
}

/// The variants: the top directory and each subdirectory (each applied on its own beside
/// vllm.yaml, so names may repeat between them).
const DIRS: [&str; 4] = ["", "dns", "epp", "replicas"];

/// Every YAML file of deploy/kubernetes/ and its subdirectories.
fn manifests() -> Vec<PathBuf> {
    let mut dirs: Vec<String> = std::fs::read_dir(repo().join("deploy/kubernetes"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    dirs.sort();
    assert_eq!(
        dirs,
        DIRS[1..].iter().map(|d| d.to_string()).collect::<Vec<_>>(),
        "a directory of deploy/kubernetes/ this test does not know"
    );
    DIRS.iter().flat_map(|d| manifests_in(d)).collect()
}

/// API groups of custom resources: no schema in Kubernetes', checked by shape here.
const CUSTOM_GROUPS: [&str; 2] = ["gateway.networking.k8s.io/", "inference.networking.k8s.io/"];

fn is_custom(o: &Value) -> bool {
    let v = o["apiVersion"].as_str().unwrap_or("");
    CUSTOM_GROUPS.iter().any(|g| v.starts_with(g))
}

/// Whether every object of a file is of a custom kind (none: built-in; a mix is refused).
fn custom_file(file: &Path) -> bool {
    let docs = documents(&std::fs::read_to_string(file).unwrap());
    let custom = docs.iter().filter(|o| is_custom(o)).count();
    assert!(
        custom == 0 || custom == docs.len(),
        "{}: custom and built-in kinds in one file; keep custom kinds in a file of their own",
        file.display()
    );
    custom > 0
}

/// Every object of deploy/kubernetes/ (the top directory): (file name, object).
fn objects() -> Vec<(String, Value)> {
    objects_in("")
}

/// Every object of one directory of deploy/kubernetes/: (file name, object).
fn objects_in(dir: &str) -> Vec<(String, Value)> {
    manifests_in(dir)
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

fn object_in(dir: &str, kind: &str, name: &str) -> Value {
    objects_in(dir)
        .into_iter()
        .map(|(_, o)| o)
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("deploy/kubernetes/{dir} has no {kind} {name}"))
}

#[test]
fn every_manifest_passes_kubernetes_schemas() {
    let files = manifests();
    assert!(!files.is_empty(), "no manifests in deploy/kubernetes/");
    let (custom, builtin): (Vec<PathBuf>, Vec<PathBuf>) =
        files.into_iter().partition(|f| custom_file(f));
    assert_eq!(
        custom,
        [repo().join("deploy/kubernetes/epp/gateway.yaml")],
        "the files of custom kinds (checked by shape in the_epp_manifests_agree_with_the_epp_vllm_and_each_other)"
    );
    let failures: Vec<String> = builtin.iter().filter_map(|f| validate(f).err()).collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // kubernetes-validate has no schema for the custom kinds: it does not pass them.
    assert!(
        validate(&custom[0]).is_err(),
        "kubernetes-validate passed the custom kinds; check them against its schemas"
    );
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

    // Its user and its drain inside the grace period: as every Deployment's, in
    // every_cacheroute_pod_runs_as_the_image_user_and_drains_in_its_grace_period.

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

/// A Deployment's (or StatefulSet's) first container.
fn container(d: &Value) -> &Value {
    &d["spec"]["template"]["spec"]["containers"][0]
}

/// A container's arguments (`args`, else `command`).
fn args_of(c: &Value) -> Vec<String> {
    let list = if c["args"].is_array() {
        &c["args"]
    } else {
        &c["command"]
    };
    list.as_array()
        .map(|a| a.iter().map(|x| x.as_str().unwrap().to_string()).collect())
        .unwrap_or_default()
}

/// The value of `FLAG=value` among `args`, if any.
fn flag(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .find_map(|a| a.strip_prefix(&format!("{name}=")))
        .map(str::to_string)
}

/// The port of `…:PORT` at the end of an address or URL.
fn port_in(s: &str) -> Option<u64> {
    s.rsplit(':').next()?.trim_end_matches('/').parse().ok()
}

/// The container port a Service port's `targetPort` (a name or a number) names.
fn target_port(c: &Value, target: &Value) -> Option<u64> {
    c["ports"].as_array()?.iter().find_map(|p| {
        (p["name"] == *target || p["containerPort"] == *target)
            .then(|| p["containerPort"].as_u64())
            .flatten()
    })
}

fn find<'a>(objs: &'a [Value], kind: &str, name: &str) -> Option<&'a Value> {
    objs.iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
}

/// What disagrees between the EPP's objects (epp/: its Deployment and Service, the
/// InferencePool, HTTPRoute and Gateway) and vLLM's (vllm.yaml), one line each: the shape
/// check of the custom kinds, which no schema here covers.
fn epp_problems(epp: &[Value], vllm: &[Value]) -> Vec<String> {
    let mut bad = Vec::new();
    let Some(pool) = epp.iter().find(|o| o["kind"] == "InferencePool") else {
        return vec!["no InferencePool".into()];
    };
    if pool["apiVersion"] != "inference.networking.k8s.io/v1" {
        bad.push(format!("InferencePool apiVersion {}", pool["apiVersion"]));
    }
    let pool_name = pool["metadata"]["name"].as_str().unwrap_or("");
    let spec = &pool["spec"];
    // The endpoint picker: a Service of the EPP, on the port the EPP listens on.
    let epr = &spec["endpointPickerRef"];
    if !(epr["kind"].is_null() || epr["kind"] == "Service") {
        bad.push(format!("endpointPickerRef kind {}", epr["kind"]));
    }
    if !matches!(
        epr["failureMode"].as_str(),
        None | Some("FailClose" | "FailOpen")
    ) {
        bad.push(format!(
            "endpointPickerRef failureMode {}",
            epr["failureMode"]
        ));
    }
    let ref_port = epr["port"]["number"].as_u64();
    match find(epp, "Service", epr["name"].as_str().unwrap_or("")) {
        None => bad.push(format!(
            "endpointPickerRef names Service {}, not in epp/",
            epr["name"]
        )),
        Some(svc) => {
            let dep = epp.iter().find(|o| {
                o["kind"] == "Deployment"
                    && svc["spec"]["selector"].as_object().is_some_and(|sel| {
                        sel.iter()
                            .all(|(k, v)| o["spec"]["template"]["metadata"]["labels"][k] == *v)
                    })
            });
            let sp = svc["spec"]["ports"]
                .as_array()
                .and_then(|ps| ps.iter().find(|p| p["port"].as_u64() == ref_port));
            match (dep, sp) {
                (None, _) => bad.push("the EPP's Service selects no Deployment".into()),
                (_, None) => bad.push(format!(
                    "endpointPickerRef port {ref_port:?} is not a port of the EPP's Service"
                )),
                (Some(dep), Some(sp)) => {
                    let c = container(dep);
                    let args = args_of(c);
                    if args.first().map(String::as_str) != Some("epp") {
                        bad.push(format!("the EPP's container runs {args:?}, not `epp`"));
                    }
                    let cport = target_port(c, &sp["targetPort"]);
                    let listen = flag(&args, "--listen").and_then(|l| port_in(&l));
                    if cport.is_none() || cport != listen {
                        bad.push(format!("the EPP's Service targets container port {cport:?}, the EPP listens on {listen:?}"));
                    }
                    let probe = &c["readinessProbe"]["grpc"];
                    if probe["port"].as_u64() != listen || probe["service"] != "readiness" {
                        bad.push(format!("the EPP's readiness probe {probe} is not gRPC `readiness` on {listen:?}"));
                    }
                    // The pool's pods and port: what the EPP finds by DNS.
                    let dns = flag(&args, "--backends-dns").unwrap_or_default();
                    let target = spec["targetPorts"][0]["number"].as_u64();
                    if port_in(&dns) != target {
                        bad.push(format!(
                            "the EPP resolves {dns}, the pool's target port is {target:?}"
                        ));
                    }
                    let host = dns.trim_start_matches("http://");
                    let service = host.split('.').next().unwrap_or("");
                    match find(vllm, "Service", service) {
                        None => bad.push(format!(
                            "the EPP resolves {dns}: no Service {service} in vllm.yaml"
                        )),
                        Some(s) if s["spec"]["clusterIP"] != "None" => bad.push(format!(
                            "Service {service} is not headless: its DNS name gives one virtual IP"
                        )),
                        Some(_) => {}
                    }
                }
            }
        }
    }
    // The pool's pods are vLLM's, at vLLM's port.
    match find(vllm, "Deployment", "vllm") {
        None => bad.push("no Deployment vllm".into()),
        Some(v) => {
            let labels = &v["spec"]["template"]["metadata"]["labels"];
            let sel = spec["selector"]["matchLabels"].as_object();
            if !sel.is_some_and(|m| !m.is_empty() && m.iter().all(|(k, x)| labels[k] == *x)) {
                bad.push(format!(
                    "the pool's selector {} does not select vLLM's pods",
                    spec["selector"]
                ));
            }
            let vport = target_port(container(v), &Value::from("http"));
            if spec["targetPorts"][0]["number"].as_u64() != vport {
                bad.push(format!(
                    "the pool's target port {} is not vLLM's {vport:?}",
                    spec["targetPorts"]
                ));
            }
        }
    }
    // The route sends to the pool and hangs off the Gateway.
    let Some(route) = epp.iter().find(|o| o["kind"] == "HTTPRoute") else {
        bad.push("no HTTPRoute".into());
        return bad;
    };
    for r in route["spec"]["rules"].as_array().into_iter().flatten() {
        for b in r["backendRefs"].as_array().into_iter().flatten() {
            if b["group"] != "inference.networking.k8s.io"
                || b["kind"] != "InferencePool"
                || b["name"] != pool_name
            {
                bad.push(format!(
                    "HTTPRoute backendRef {b} is not the InferencePool {pool_name}"
                ));
            }
        }
    }
    for p in route["spec"]["parentRefs"].as_array().into_iter().flatten() {
        match find(epp, "Gateway", p["name"].as_str().unwrap_or("")) {
            Some(g)
                if g["spec"]["listeners"]
                    .as_array()
                    .is_some_and(|l| l.iter().any(|l| l["protocol"] == "HTTP")) => {}
            Some(_) => bad.push(format!("Gateway {} has no HTTP listener", p["name"])),
            None => bad.push(format!(
                "HTTPRoute parentRef {} is not a Gateway in epp/",
                p["name"]
            )),
        }
    }
    bad
}

fn values(dir: &str) -> Vec<Value> {
    objects_in(dir).into_iter().map(|(_, o)| o).collect()
}

#[test]
fn the_epp_manifests_agree_with_the_epp_vllm_and_each_other() {
    let (epp, vllm) = (values("epp"), values(""));
    let problems = epp_problems(&epp, &vllm);
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    // Each broken copy is caught.
    type Break = fn(&mut Value);
    let breaks: [(&str, &str, Break); 6] = [
        ("InferencePool", "the picker's port", |o| {
            o["spec"]["endpointPickerRef"]["port"]["number"] = 9003.into()
        }),
        ("InferencePool", "the picker's Service", |o| {
            o["spec"]["endpointPickerRef"]["name"] = "epp".into()
        }),
        ("InferencePool", "the pool's pods", |o| {
            o["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] = "sglang".into()
        }),
        ("InferencePool", "the pool's port", |o| {
            o["spec"]["targetPorts"][0]["number"] = 8001.into()
        }),
        ("HTTPRoute", "the route's pool", |o| {
            o["spec"]["rules"][0]["backendRefs"][0]["name"] = "other".into()
        }),
        ("Deployment", "the EPP's listen port", |o| {
            let args = o["spec"]["template"]["spec"]["containers"][0]["args"]
                .as_array_mut()
                .unwrap();
            for a in args.iter_mut() {
                if a.as_str().unwrap().starts_with("--listen=") {
                    *a = "--listen=0.0.0.0:9009".into();
                }
            }
        }),
    ];
    for (kind, what, f) in breaks {
        let mut copy = epp.clone();
        f(copy.iter_mut().find(|o| o["kind"] == kind).unwrap());
        assert!(
            !epp_problems(&copy, &vllm).is_empty(),
            "{what} changed and no problem seen"
        );
    }
}

/// What disagrees between the replicas' router and the etcd of replicas/, one line each.
fn etcd_problems(objs: &[Value]) -> Vec<String> {
    let mut bad = Vec::new();
    let (Some(router), Some(sts)) = (
        find(objs, "Deployment", "cacheroute"),
        objs.iter().find(|o| o["kind"] == "StatefulSet"),
    ) else {
        return vec!["replicas/ needs a Deployment cacheroute and an etcd StatefulSet".into()];
    };
    if router["spec"]["replicas"].as_u64().unwrap_or(1) < 2 {
        bad.push("fewer than two router replicas".into());
    }
    let args = args_of(container(router));
    let Some(url) = flag(&args, "--etcd") else {
        return vec!["the replicas have no --etcd".into()];
    };
    // http://STS-0.SERVICE[.NS.svc.cluster.local]:PORT: the member's stable name.
    let host = url
        .trim_start_matches("http://")
        .split(':')
        .next()
        .unwrap_or("");
    let mut labels = host.split('.');
    let (member, service) = (labels.next().unwrap_or(""), labels.next().unwrap_or(""));
    let sts_name = sts["metadata"]["name"].as_str().unwrap_or("");
    if member != format!("{sts_name}-0") || sts["spec"]["serviceName"] != service {
        bad.push(format!(
            "--etcd {url} does not name the StatefulSet's member {sts_name}-0.{}",
            sts["spec"]["serviceName"]
        ));
    }
    match find(objs, "Service", service) {
        Some(s) if s["spec"]["clusterIP"] == "None" => {
            let port = port_in(&url);
            let ok = s["spec"]["ports"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|p| {
                    p["port"].as_u64() == port
                        && target_port(container(sts), &p["targetPort"]) == port
                });
            if !ok {
                bad.push(format!("--etcd port {port:?} is not etcd's client port"));
            }
            let listen =
                flag(&args_of(container(sts)), "--advertise-client-urls").unwrap_or_default();
            if port_in(&listen) != port {
                bad.push(format!("etcd advertises {listen}, the replicas use {url}"));
            }
        }
        _ => bad.push(format!("no headless Service {service} for etcd")),
    }
    bad
}

#[test]
fn the_replicas_name_their_etcd() {
    let objs = values("replicas");
    let problems = etcd_problems(&objs);
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    for (what, from, to) in [
        (
            "the member's name",
            "cacheroute-etcd-0.cacheroute-etcd",
            "cacheroute-etcd-1.cacheroute-etcd",
        ),
        (
            "the client port",
            ".cluster.local:2379",
            ".cluster.local:2381",
        ),
    ] {
        let copy: Vec<Value> = objs
            .iter()
            .map(|o| serde_json::from_str(&o.to_string().replace(from, to)).unwrap())
            .map(|mut o: Value| {
                // Only the router's flag changes.
                if o["kind"] == "StatefulSet" {
                    o = find(
                        &objs,
                        "StatefulSet",
                        o["metadata"]["name"].as_str().unwrap(),
                    )
                    .unwrap()
                    .clone();
                }
                o
            })
            .collect();
        assert!(
            !etcd_problems(&copy).is_empty(),
            "{what} changed and no problem seen"
        );
    }
}

/// Every Deployment running the cacheroute image, in every variant: its user is the image's,
/// its drain ends inside the grace period.
#[test]
fn every_cacheroute_pod_runs_as_the_image_user_and_drains_in_its_grace_period() {
    let containerfile = std::fs::read_to_string(repo().join("deploy/Containerfile")).unwrap();
    let uid = containerfile
        .lines()
        .find_map(|l| l.strip_prefix("USER "))
        .and_then(|u| u.split(':').next())
        .expect("the Containerfile names a USER")
        .trim()
        .to_string();
    let mut seen = 0;
    for dir in DIRS {
        for (file, d) in objects_in(dir) {
            if d["kind"] != "Deployment"
                || !container(&d)["image"]
                    .as_str()
                    .unwrap_or("")
                    .contains("cacheroute")
            {
                continue;
            }
            seen += 1;
            let pod = &d["spec"]["template"]["spec"];
            let at = format!("{dir}/{file} {}", d["metadata"]["name"]);
            assert_eq!(pod["securityContext"]["runAsUser"].to_string(), uid, "{at}");
            assert_eq!(pod["securityContext"]["runAsNonRoot"], true, "{at}");
            let args = args_of(container(&d));
            let drain: f64 = flag(&args, "--drain-timeout-s")
                .expect("--drain-timeout-s")
                .parse()
                .unwrap();
            let pause = container(&d)["lifecycle"]["preStop"]["sleep"]["seconds"]
                .as_f64()
                .unwrap_or(0.0);
            let grace = pod["terminationGracePeriodSeconds"]
                .as_f64()
                .unwrap_or(30.0);
            assert!(
                drain + pause < grace,
                "{at}: drain {drain} s + preStop {pause} s ≥ grace {grace} s"
            );
            let listen = flag(&args, "--listen").and_then(|l| port_in(&l));
            assert_eq!(
                container(&d)["ports"][0]["containerPort"].as_u64(),
                listen,
                "{at}"
            );
        }
    }
    assert_eq!(
        seen, 4,
        "router.yaml, dns/, replicas/ and epp/ each run the image"
    );
}

/// `args` as a test can run them here: listening on a free loopback port, asking `dns` for
/// names, etcd at `etcd`.
fn here(args: &[String], dns: &Dnsmasq, etcd: Option<&str>) -> Vec<String> {
    let mut v: Vec<String> = args
        .iter()
        .map(|a| {
            if a.starts_with("--listen=") {
                "--listen=127.0.0.1:0".to_string()
            } else if let (true, Some(e)) = (a.starts_with("--etcd="), etcd) {
                format!("--etcd={e}")
            } else {
                a.clone()
            }
        })
        .collect();
    v.push(format!("--dns-server={}", dns.server()));
    v
}

fn start(args: &[String]) -> Proc {
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    Proc::start(&refs)
}

fn completes(url: &str) -> u16 {
    reqwest::blocking::Client::new()
        .post(format!("{url}/v1/completions"))
        .header("content-type", "application/json")
        .body(r#"{"model":"m","prompt":"hello","max_tokens":2}"#)
        .send()
        .map(|r| r.status().as_u16())
        .unwrap_or(0)
}

/// The router of dns/ and the three replicas of replicas/ (two started, sharing an etcd) find
/// an engine through the SRV records their manifests name and serve a completion; the EPP of
/// epp/ starts on its manifest's arguments. A dnsmasq stands in for the cluster's DNS,
/// answering the manifests' names with loopback addresses; an etcd for the StatefulSet.
#[test]
fn the_variants_start_with_their_arguments_and_route() {
    let e = Proc::emulator();
    let eport = port_in(&e.url).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let ns = "default.svc.cluster.local";
    let dns = Dnsmasq::start(
        dir.path(),
        "cluster.local",
        &(hosts(&format!("vllm.{ns}"), &["127.0.0.1"])
            + &hosts(&format!("vllm-0.vllm.{ns}"), &["127.0.0.1"])),
        &[format!(
            "--srv-host=_http._tcp.vllm.{ns},vllm-0.vllm.{ns},{eport}"
        )],
    );
    let until_200 = |url: &str| {
        let t0 = std::time::Instant::now();
        while completes(url) != 200 {
            assert!(
                t0.elapsed() < std::time::Duration::from_secs(20),
                "{url} served no completion"
            );
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    };

    let single = args_of(container(&object_in("dns", "Deployment", "cacheroute")));
    let r = start(&here(&single, &dns, None));
    until_200(&r.url);
    let (st, err) = r.terminate();
    assert!(st.success(), "{err}");

    let etcd = Etcd::start();
    let replicas = args_of(container(&object_in(
        "replicas",
        "Deployment",
        "cacheroute",
    )));
    let a = start(&here(&replicas, &dns, Some(&etcd.url())));
    let b = start(&here(&replicas, &dns, Some(&etcd.url())));
    until_200(&a.url);
    until_200(&b.url);
    for r in [a, b] {
        let (st, err) = r.terminate();
        assert!(st.success(), "{err}");
    }

    let epp = args_of(container(&object_in("epp", "Deployment", "cacheroute-epp")));
    let p = start(&here(&epp, &dns, None));
    assert!(p.url.starts_with("grpc://127.0.0.1:"), "{}", p.url);
    let (st, err) = p.terminate();
    assert!(st.success(), "{err}");
}

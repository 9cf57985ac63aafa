//! The recorder's parts without HTTP: usage parsing, the reorder buffer (time as an input),
//! rotation and continuation on real files in a temporary directory, and drops.

use super::*;
use crate::workload::trace::{ReaderOptions, TraceReader};

fn rec(seq: u64, arrival_ms: f64) -> Rec {
    Rec {
        seq,
        arrival_ms,
        key: seq,
        input_length: 16,
        output_length: 4,
        hash_ids: vec![seq],
        status: 200,
        complete: true,
        ..Rec::default()
    }
}

/// Every record of a trace file, read by the project's reader (errors fail the test).
fn read(path: &Path) -> Vec<TraceRecord> {
    let f = std::io::BufReader::new(File::open(path).unwrap());
    TraceReader::new(f, ReaderOptions::default())
        .collect::<Result<Vec<_>, _>>()
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn completion_tokens_come_from_the_last_usage() {
    let json = br#"{"id":"x","choices":[{"text":"a \"completion_tokens\": 99"}],"usage":{"prompt_tokens":5,"completion_tokens":12,"completion_tokens_details":null,"total_tokens":17}}"#;
    assert_eq!(completion_tokens(json), Some(12));
    let sse = b"data: {\"choices\":[{\"text\":\" g1\"}],\"usage\":{\"completion_tokens\" : 1}}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":\n7}}\n\ndata: [DONE]\n\n";
    assert_eq!(completion_tokens(sse), Some(7));
    for none in [
        &b"data: {\"choices\":[{\"text\":\" g1\"}]}\n\ndata: [DONE]\n\n"[..],
        br#"{"text":"\"completion_tokens\":5"}"#,
        br#"{"usage":{"completion_tokens":null}}"#,
        br#"{"usage":{"completion_tokens":-3}}"#,
        b"",
    ] {
        assert_eq!(
            completion_tokens(none),
            None,
            "{}",
            String::from_utf8_lossy(none)
        );
    }
}

#[test]
fn the_tail_keeps_the_end_of_the_body_across_chunk_boundaries() {
    let (tx, _rx) = std::sync::mpsc::sync_channel(1);
    let r = Arc::new(Recorder {
        tx,
        seq: AtomicU64::new(0),
        epoch: Instant::now(),
        stats: Arc::default(),
        gone: Arc::default(),
        writer: Mutex::new(None),
        path: PathBuf::from("x"),
    });
    let mut c = r.begin(Instant::now(), 1, 2, vec![], Some(100));
    let filler = vec![b'x'; 3 * TAIL_BYTES];
    c.chunk(&filler);
    // The usage split into 3-byte pieces after lots of body.
    let end = br#"{"usage":{"prompt_tokens":3,"completion_tokens":42}}"#;
    for _ in 0..50 {
        c.chunk(&filler[..100]);
    }
    for piece in end.chunks(3) {
        c.chunk(piece);
    }
    assert!(c.tail.len() <= 2 * TAIL_BYTES);
    assert_eq!(completion_tokens(&c.tail), Some(42));
    // A body larger than the tail in one piece.
    let mut big = vec![b' '; 10 * TAIL_BYTES];
    big.extend_from_slice(end);
    c.chunk(&big);
    assert_eq!(completion_tokens(&c.tail), Some(42));
}

#[test]
fn reorder_releases_in_arrival_order_and_gives_up_after_the_hold() {
    let hold = Duration::from_secs(10);
    let mut o = Reorder::new(hold);
    let t = Instant::now();
    let mut out = Vec::new();
    let mut emit = |r: Rec| out.push(r.seq);
    // Finished out of order: released in sequence.
    o.push(rec(2, 2.0), t, &mut emit);
    o.push(rec(1, 1.0), t, &mut emit);
    o.pump(t, false, &mut emit);
    o.push(rec(0, 0.0), t, &mut emit);
    o.pump(t, false, &mut emit);
    assert_eq!(out, [0, 1, 2]);
    out.clear();
    // 3 and 5 are still running; 4 and 6 wait for them, each up to the hold.
    o.push(rec(4, 4.0), t, &mut out_push(&mut out));
    o.push(
        rec(6, 6.0),
        t + Duration::from_secs(5),
        &mut out_push(&mut out),
    );
    o.pump(
        t + hold - Duration::from_millis(1),
        false,
        &mut out_push(&mut out),
    );
    assert!(out.is_empty(), "released before the hold: {out:?}");
    o.pump(t + hold, false, &mut out_push(&mut out));
    assert_eq!(out, [4], "4 waited the hold; 6 has not yet");
    o.pump(
        t + hold + Duration::from_secs(5),
        false,
        &mut out_push(&mut out),
    );
    assert_eq!(out, [4, 6]);
    // 3 and 5 finish after their successors went out: released at once (late).
    o.push(rec(5, 5.0), t + hold * 2, &mut out_push(&mut out));
    o.push(rec(3, 3.0), t + hold * 2, &mut out_push(&mut out));
    assert_eq!(out, [4, 6, 5, 3]);
    // A dropped record is not waited for.
    out.clear();
    o.push(rec(8, 8.0), t + hold * 2, &mut out_push(&mut out));
    o.gone(7);
    o.pump(t + hold * 2, false, &mut out_push(&mut out));
    assert_eq!(out, [8]);
    out.clear();
    o.gone(9);
    o.push(rec(10, 10.0), t + hold * 2, &mut out_push(&mut out));
    o.pump(t + hold * 2, false, &mut out_push(&mut out));
    assert_eq!(out, [10]);
    // At the end everything held goes, in order, gaps or not.
    o.push(rec(14, 14.0), t + hold * 2, &mut out_push(&mut out));
    o.push(rec(12, 12.0), t + hold * 2, &mut out_push(&mut out));
    o.pump(t + hold * 2, false, &mut out_push(&mut out));
    assert_eq!(out, [10]);
    o.pump(t + hold * 2, true, &mut out_push(&mut out));
    assert_eq!(out, [10, 12, 14]);
    assert_eq!(o.records_held(), 0);
}

fn out_push(out: &mut Vec<u64>) -> impl FnMut(Rec) + '_ {
    move |r: Rec| out.push(r.seq)
}

#[test]
fn reorder_bounds_what_it_holds() {
    let mut o = Reorder::new(Duration::from_secs(3600));
    o.max_held = 3;
    let t = Instant::now();
    let mut out = Vec::new();
    // Every other record never comes: past 3 held, the oldest gap is given up.
    for s in [1, 3, 5, 7, 9] {
        o.push(rec(s, s as f64), t, &mut out_push(&mut out));
        o.pump(t, false, &mut out_push(&mut out));
        assert!(o.records_held() <= 3, "{} held", o.records_held());
    }
    assert_eq!(out, [1, 3]);
}

fn recorder(cfg: &RecordConfig) -> Arc<Recorder> {
    Recorder::open(Some(cfg), None).unwrap_or_else(|e| panic!("{e}"))
}

/// Capture `n` requests (finished in order) and close the recording.
fn record_n(r: &Arc<Recorder>, n: usize) {
    for i in 0..n {
        let mut c = r.begin(Instant::now(), i as u64, 40, vec![1, 2, 3], Some(8));
        c.answered(Some(i % 2), 200);
        c.first_byte();
        c.chunk(br#"{"usage":{"completion_tokens":5}}"#);
        c.complete();
    }
}

#[test]
fn rotation_keeps_k_files_each_a_trace_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rec.jsonl");
    let mut cfg = RecordConfig::new(&path);
    cfg.max_bytes = 600; // a few records per file
    cfg.keep = 3;
    let r = recorder(&cfg);
    record_n(&r, 40);
    let s = r.finish();
    assert_eq!((s.written, s.dropped, s.write_errors), (40, 0, 0));
    assert!(s.rotations >= 4, "{s:?}");
    let names: Vec<PathBuf> = [path.clone()]
        .into_iter()
        .chain((1..=3).map(|i| rotated(&path, i)))
        .collect();
    assert!(
        !rotated(&path, 4).exists(),
        "more than keep = 3 rotated files"
    );
    let mut total = 0;
    let mut prev_last = f64::INFINITY;
    // Newest first: FILE, FILE.1, …: each a trace; each older file ends before the newer begins.
    for p in &names {
        let recs = read(p);
        assert!(std::fs::metadata(p).unwrap().len() <= 600);
        assert!(recs.last().unwrap().timestamp_ms <= prev_last);
        prev_last = recs[0].timestamp_ms;
        for x in &recs {
            assert_eq!(x.key.len(), 16);
            assert_eq!((x.input_length, x.output_length), (40, 5));
        }
        total += recs.len();
    }
    assert!((4..40).contains(&total), "{total}");
    // The dropped-by-rotation ones are the oldest: the newest record is the last one written.
    assert_eq!(read(&path).last().unwrap().key, format!("{:016x}", 39));
}

#[test]
fn keep_zero_deletes_rotated_files() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rec.jsonl");
    let mut cfg = RecordConfig::new(&path);
    cfg.max_bytes = 1;
    cfg.keep = 0;
    let r = recorder(&cfg);
    record_n(&r, 5);
    assert_eq!(r.finish().written, 5);
    assert_eq!(
        read(&path).len(),
        1,
        "one line longer than max_bytes per file"
    );
    assert!(!rotated(&path, 1).exists());
}

#[test]
fn a_recording_continues_an_existing_trace_and_refuses_other_files() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rec.jsonl");
    std::fs::write(
        &path,
        "{\"timestamp\":0,\"key\":\"a\",\"input_length\":1,\"output_length\":1,\"hash_ids\":[1]}\n{\"timestamp\":5000.5,\"key\":\"a\",\"input_length\":1,\"output_length\":1,\"hash_ids\":[1]}\n{\"timestamp\":60",
    )
    .unwrap();
    let cfg = RecordConfig::new(&path);
    let r = recorder(&cfg);
    record_n(&r, 3);
    assert_eq!(r.finish().written, 3);
    let recs = read(&path);
    assert_eq!(recs.len(), 5, "the cut last line was removed");
    assert!(recs[2].timestamp_ms >= 5000.5, "{recs:?}");

    // A file that is not a trace, a missing directory, a directory: refused, naming --record.
    let other = dir.path().join("notes.txt");
    std::fs::write(&other, "policy: sticky\nbackends: []\n").unwrap();
    let refused = |p: &Path| match Recorder::open(Some(&RecordConfig::new(p)), None) {
        Ok(_) => panic!("{} accepted", p.display()),
        Err(e) => e,
    };
    for (p, why) in [
        (other.clone(), "not a trace"),
        (dir.path().join("no/such/dir/rec.jsonl"), "does not exist"),
        (dir.path().to_path_buf(), "is a directory"),
    ] {
        let e = refused(&p);
        assert!(e.starts_with("--record ") && e.contains(why), "{e}");
        assert!(!e.contains('\n'), "one line: {e}");
    }
    assert_eq!(
        std::fs::read_to_string(&other).unwrap(),
        "policy: sticky\nbackends: []\n",
        "left as it was"
    );
}

#[test]
fn a_full_queue_drops_and_counts_and_nothing_waits_for_the_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rec.jsonl");
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    let stats = Arc::new(Stats::default());
    let gone = Arc::new(Mutex::new(Vec::new()));
    let r = Arc::new(Recorder {
        tx,
        seq: AtomicU64::new(0),
        epoch: Instant::now(),
        stats: stats.clone(),
        gone: gone.clone(),
        writer: Mutex::new(None),
        path: path.clone(),
    });
    // No writer yet: the first record fills the queue, the next two are dropped.
    record_n(&r, 3);
    assert_eq!(r.summary().dropped, 2);
    assert_eq!(*gone.lock().unwrap(), [1, 2]);
    // A writer that would hold records for an hour still writes seq 3 at once: 1 and 2 are
    // known to be gone.
    let (file, size, offset_ms) = prepare(&path).unwrap();
    let w = Writer {
        window: None,
        sink: Some(Sink {
            path: path.clone(),
            file: BufWriter::new(file),
            size,
            rotate_at: u64::MAX,
            max_bytes: u64::MAX,
            keep: 1,
            stats: stats.clone(),
            noted: false,
        }),
        order: Reorder::new(Duration::from_secs(3600)),
        line: Vec::new(),
        last_ts: offset_ms,
        offset_ms,
        stats: stats.clone(),
    };
    let g = gone.clone();
    let t = std::thread::spawn(move || w.run(rx, g));
    let deadline = Instant::now() + Duration::from_secs(20);
    while r.summary().written < 1 {
        assert!(Instant::now() < deadline, "seq 0 not written");
        std::thread::sleep(Duration::from_millis(20));
    }
    record_n(&r, 1);
    let deadline = Instant::now() + Duration::from_secs(20);
    while r.summary().written < 2 {
        assert!(
            Instant::now() < deadline,
            "seq 3 waited for dropped records"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    *r.writer.lock().unwrap() = Some(t);
    let s = r.finish();
    assert_eq!((s.written, s.dropped), (2, 2));
    assert_eq!(read(&path).len(), 2);
}

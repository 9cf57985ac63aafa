//! Traffic capture (`cacheroute route --record FILE`): one trace line (docs/trace-format.md) per
//! request the router routes, written off the request path.
//!
//! The request path opens a [`Capture`] once a request has its routing key. It follows the
//! request — the attempt that answers, the response stream — and when it is dropped (the body
//! ended, the client went away, or the router answered an error itself) it hands one record to
//! a bounded channel with `try_send`: a full channel drops the record and counts it, so
//! recording never blocks or fails a request. A writer thread puts the records back in arrival
//! order ([`Reorder`]: requests finish out of order), writes them, flushes at least every
//! second and rotates the file by size ([`Sink`]).
//!
//! What is written: the routing key's 64-bit hash, word counts, block hashes, the destination,
//! status and timings — never prompt or completion text (docs/router.md, "Recording traffic").
//! Uses `workload::trace` for the line format; nothing outside the router uses this file.

use super::config::RecordConfig;
use crate::workload::trace::{encode_line, parse_line, ReaderOptions, TraceRecord};
use std::collections::{BTreeMap, VecDeque};
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

/// Written records reach the file at least this often.
const FLUSH_EVERY: Duration = Duration::from_secs(1);
/// Bytes of a response's end kept to find its `usage.completion_tokens`.
const TAIL_BYTES: usize = 2048;
/// Records held for ordering at most (about 1 KiB each with a 2k-word prompt's block ids);
/// past it the oldest gap is given up.
const MAX_HELD: usize = 1 << 16;
/// Dropped sequence numbers remembered at most until the writer reads them.
const MAX_GONE: usize = 1 << 20;
/// Longest first or last line read when checking an existing file.
const PROBE_BYTES: u64 = 64 << 10;

/// What a recording did, for `/admin/stats`, `/metrics` and the shutdown log.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RecordSummary {
    pub path: PathBuf,
    /// Records written (all files).
    pub written: u64,
    /// Records lost because the channel to the writer was full (or the writer had stopped).
    pub dropped: u64,
    /// Records written with their timestamp moved up by 1 ms or more (`clamped_ms`).
    pub late: u64,
    /// Failed writes, flushes or rotations (each says so once on stderr).
    pub write_errors: u64,
    /// Files rotated.
    pub rotations: u64,
    /// Records finished and waiting for earlier requests (a gauge).
    pub held: u64,
}

#[derive(Debug, Default)]
struct Stats {
    written: AtomicU64,
    dropped: AtomicU64,
    late: AtomicU64,
    write_errors: AtomicU64,
    rotations: AtomicU64,
    held: AtomicU64,
}

/// Where `output_length` came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum OutputFrom {
    /// The response's `usage.completion_tokens`.
    Usage,
    /// The request's `max_completion_tokens` / `max_tokens`.
    MaxTokens,
    /// Neither: 0.
    #[default]
    None,
}

/// The most recent records in memory, for CacheRoute's self-calibration (oldest first, at
/// most [`WINDOW_MAX`]).
pub(crate) type Window = Arc<Mutex<VecDeque<TraceRecord>>>;

/// Records a [`Window`] keeps (the self-calibration replays at most this many).
pub(crate) const WINDOW_MAX: usize = crate::control::MAX_REPLAY;

/// One finished request, as the writer receives it.
#[derive(Debug, Clone, Default)]
struct Rec {
    seq: u64,
    /// ms from the recorder's start to the request's arrival.
    arrival_ms: f64,
    key: u64,
    input_length: u32,
    output_length: u32,
    output_from: OutputFrom,
    hash_ids: Vec<u64>,
    destination: Option<u16>,
    status: u16,
    ttft_ms: Option<f64>,
    e2e_ms: f64,
    complete: bool,
}

enum Msg {
    Rec(Rec),
    Stop,
}

/// The recording: the channel to the writer thread and its counters. One per router.
pub(crate) struct Recorder {
    tx: SyncSender<Msg>,
    seq: AtomicU64,
    epoch: Instant,
    stats: Arc<Stats>,
    /// Sequence numbers whose record was dropped, so the writer does not wait for them.
    gone: Arc<Mutex<Vec<u64>>>,
    writer: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// The `--record` file (empty when only a [`Window`] is kept).
    path: PathBuf,
}

/// Why a recording cannot start; the message names `--record` and what to do.
fn refuse(path: &Path, what: impl std::fmt::Display) -> String {
    format!("--record {}: {what}", path.display())
}

impl Recorder {
    /// Check the path, open (or continue) the file and start the writer thread. Everything
    /// that can be wrong with the path is found here, before the router listens. With a
    /// `window`, every record also goes there (with or without a file).
    pub fn open(cfg: Option<&RecordConfig>, window: Option<Window>) -> Result<Arc<Self>, String> {
        let path = cfg.map(|c| c.path.clone()).unwrap_or_default();
        let stats = Arc::new(Stats::default());
        let (sink, offset_ms) = match cfg {
            Some(cfg) => {
                let (file, size, offset_ms) = prepare(&path)?;
                let sink = Sink {
                    path: path.clone(),
                    file: BufWriter::with_capacity(64 << 10, file),
                    size,
                    rotate_at: cfg.max_bytes,
                    max_bytes: cfg.max_bytes,
                    keep: cfg.keep,
                    stats: stats.clone(),
                    noted: false,
                };
                (Some(sink), offset_ms)
            }
            None => (None, 0.0),
        };
        let queue = cfg.map_or(super::config::DEFAULT_RECORD_QUEUE, |c| c.queue);
        let hold = cfg.map_or(super::config::DEFAULT_RECORD_HOLD, |c| c.hold);
        let (tx, rx) = std::sync::mpsc::sync_channel(queue);
        let gone = Arc::new(Mutex::new(Vec::new()));
        let writer = Writer {
            sink,
            window,
            order: Reorder::new(hold),
            line: Vec::with_capacity(1024),
            last_ts: offset_ms,
            offset_ms,
            stats: stats.clone(),
        };
        let g = gone.clone();
        let handle = std::thread::Builder::new()
            .name("router-record".into())
            .spawn(move || writer.run(rx, g))
            .map_err(|e| refuse(&path, format!("cannot start the writer thread: {e}")))?;
        Ok(Arc::new(Self {
            tx,
            seq: AtomicU64::new(0),
            epoch: Instant::now(),
            stats,
            gone,
            writer: Mutex::new(Some(handle)),
            path,
        }))
    }

    /// Start capturing a request that arrived at `t0` and was given routing key `key`.
    pub fn begin(
        self: &Arc<Self>,
        t0: Instant,
        key: u64,
        input_length: u32,
        hash_ids: Vec<u64>,
        max_tokens: Option<u64>,
    ) -> Capture {
        let seq = self.seq.fetch_add(1, Relaxed);
        let arrival_ms = t0.saturating_duration_since(self.epoch).as_secs_f64() * 1e3;
        Capture {
            rec: self.clone(),
            t0,
            max_tokens: max_tokens.map(|m| m.min(u32::MAX as u64) as u32),
            tail: Vec::new(),
            r: Rec {
                seq,
                arrival_ms,
                key,
                input_length,
                output_length: 0,
                output_from: OutputFrom::None,
                hash_ids,
                destination: None,
                status: 0,
                ttft_ms: None,
                e2e_ms: 0.0,
                complete: false,
            },
        }
    }

    fn submit(&self, r: Rec) {
        let seq = r.seq;
        match self.tx.try_send(Msg::Rec(r)) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                self.stats.dropped.fetch_add(1, Relaxed);
                if let Ok(mut g) = self.gone.lock() {
                    // Bounded even if the writer is stuck for long: past it, the writer gives
                    // up on the gaps after the hold instead.
                    if g.len() < MAX_GONE {
                        g.push(seq);
                    }
                }
            }
            Err(TrySendError::Disconnected(_)) => {
                self.stats.dropped.fetch_add(1, Relaxed);
            }
        }
    }

    pub fn summary(&self) -> RecordSummary {
        let s = &self.stats;
        RecordSummary {
            path: self.path.clone(),
            written: s.written.load(Relaxed),
            dropped: s.dropped.load(Relaxed),
            late: s.late.load(Relaxed),
            write_errors: s.write_errors.load(Relaxed),
            rotations: s.rotations.load(Relaxed),
            held: s.held.load(Relaxed),
        }
    }

    /// Write everything held, flush, sync and stop the writer. Records of requests still
    /// running after this are dropped (and counted). Idempotent.
    pub fn finish(&self) -> RecordSummary {
        let handle = self.writer.lock().ok().and_then(|mut w| w.take());
        if let Some(h) = handle {
            // Blocking: the writer drains the channel, so the stop gets through.
            if self.tx.send(Msg::Stop).is_ok() {
                let _ = h.join();
            }
        }
        self.summary()
    }
}

/// One request being captured. Dropping it submits its record.
pub(crate) struct Capture {
    rec: Arc<Recorder>,
    t0: Instant,
    max_tokens: Option<u32>,
    /// The last bytes of the response, for its `usage`.
    tail: Vec<u8>,
    r: Rec,
}

impl Capture {
    /// The answer (or error) the client gets: its status and the destination it came from.
    pub fn answered(&mut self, destination: Option<usize>, status: u16) {
        self.r.destination = destination.and_then(|d| u16::try_from(d).ok());
        self.r.status = status;
    }

    /// The destination's first body byte is in hand.
    pub fn first_byte(&mut self) {
        self.r.ttft_ms = Some(self.t0.elapsed().as_secs_f64() * 1e3);
    }

    /// A piece of the response body on its way to the client.
    pub fn chunk(&mut self, b: &[u8]) {
        if b.len() >= TAIL_BYTES {
            self.tail.clear();
            self.tail
                .extend_from_slice(b.get(b.len() - TAIL_BYTES..).unwrap_or(b));
            return;
        }
        if self.tail.len() + b.len() > 2 * TAIL_BYTES {
            let cut = self.tail.len() + b.len() - TAIL_BYTES;
            self.tail.drain(..cut.min(self.tail.len()));
        }
        self.tail.extend_from_slice(b);
    }

    /// The response body ended cleanly (not cut, not abandoned by the client).
    pub fn complete(&mut self) {
        self.r.complete = true;
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        let mut r = std::mem::take(&mut self.r);
        r.e2e_ms = self.t0.elapsed().as_secs_f64() * 1e3;
        (r.output_length, r.output_from) = match (completion_tokens(&self.tail), self.max_tokens) {
            (Some(n), _) => (n, OutputFrom::Usage),
            (None, Some(m)) => (m, OutputFrom::MaxTokens),
            (None, None) => (0, OutputFrom::None),
        };
        self.rec.submit(r);
    }
}

/// The last `"completion_tokens": N` in `tail` (a JSON response's or an SSE stream's end:
/// vLLM, SGLang and the emulator put `usage` last). In generated text a quote is escaped, so
/// text cannot fake the pattern.
fn completion_tokens(tail: &[u8]) -> Option<u32> {
    const PAT: &[u8] = b"\"completion_tokens\"";
    let at = tail.windows(PAT.len()).rposition(|w| w == PAT)?;
    let mut rest = tail.get(at + PAT.len()..)?;
    let skip_ws = |r: &mut &[u8]| {
        while let Some((b' ' | b'\t' | b'\r' | b'\n', more)) = r.split_first() {
            *r = more;
        }
    };
    skip_ws(&mut rest);
    rest = rest.strip_prefix(b":")?;
    skip_ws(&mut rest);
    let n = rest.iter().take_while(|c| c.is_ascii_digit()).count();
    if n == 0 || n > 10 {
        return None;
    }
    std::str::from_utf8(rest.get(..n)?).ok()?.parse().ok()
}

/// Check `path` and open it for appending: (file, its size, the timestamp to continue from).
///
/// Refused: a directory, a missing parent directory, a parent where files cannot be created
/// (rotation creates and renames files there), a file that is not a trace. An existing trace
/// is continued: new timestamps start after its last one plus the time since it was last
/// written (its modification time), so the old and new records read as one recording. A last
/// line cut short (a router killed mid-write) is removed first.
fn prepare(path: &Path) -> Result<(File, u64, f64), String> {
    if path.is_dir() {
        return Err(refuse(path, "is a directory; give a file path"));
    }
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if !dir.is_dir() {
        return Err(refuse(
            path,
            format!(
                "directory {} does not exist; create it or record elsewhere",
                dir.display()
            ),
        ));
    }
    let name = path
        .file_name()
        .ok_or_else(|| refuse(path, "has no file name; give a file path"))?
        .to_string_lossy()
        .into_owned();
    let probe = dir.join(format!(".{name}.probe-{}", std::process::id()));
    match OpenOptions::new().write(true).create_new(true).open(&probe) {
        Ok(_) => {
            let _ = std::fs::remove_file(&probe);
        }
        Err(e) => {
            return Err(refuse(
                path,
                format!(
                    "cannot create files in {} ({e}); rotation needs a writable directory",
                    dir.display()
                ),
            ))
        }
    }
    let mut offset_ms = None;
    if let Ok(meta) = std::fs::metadata(path) {
        if meta.len() > 0 {
            let last = check_trace(path, true)?;
            offset_ms = Some(continue_after(last, &meta));
        }
    }
    if offset_ms.is_none() {
        // A fresh FILE after a rotation: continue from FILE.1, if it is a trace.
        let prev = rotated(path, 1);
        if let Ok(meta) = std::fs::metadata(&prev) {
            if meta.len() > 0 {
                if let Ok(last) = check_trace(&prev, false) {
                    offset_ms = Some(continue_after(last, &meta));
                }
            }
        }
    }
    let file = OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| refuse(path, format!("cannot open for writing ({e})")))?;
    let size = file
        .metadata()
        .map_err(|e| refuse(path, format!("cannot read its size ({e})")))?
        .len();
    Ok((file, size, offset_ms.unwrap_or(0.0)))
}

fn continue_after(last_ts: f64, meta: &std::fs::Metadata) -> f64 {
    let gap = meta
        .modified()
        .ok()
        .and_then(|m| SystemTime::now().duration_since(m).ok())
        .map_or(0.0, |d| d.as_secs_f64() * 1e3);
    ((last_ts + gap) * 1e3).round() / 1e3
}

/// `path.N`.
fn rotated(path: &Path, n: usize) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(format!(".{n}"));
    PathBuf::from(s)
}

/// Whether a non-empty file reads as a trace, judged by its first and last lines; its last
/// timestamp. With `repair`, a last line cut short is removed, and a valid last line without
/// its newline gets one.
fn check_trace(path: &Path, repair: bool) -> Result<f64, String> {
    let not_trace = |why: String| {
        refuse(
            path,
            format!(
                "exists and is not a trace ({why}); move it away or record to another file (an existing trace is appended to)"
            ),
        )
    };
    let mut f = OpenOptions::new()
        .read(true)
        .write(repair)
        .open(path)
        .map_err(|e| {
            refuse(
                path,
                format!("exists but cannot be opened ({e}); check its permissions"),
            )
        })?;
    let len = f
        .metadata()
        .map_err(|e| refuse(path, format!("cannot read its size ({e})")))?
        .len();
    let opts = ReaderOptions::default();
    let mut head = Vec::new();
    (&mut f)
        .take(PROBE_BYTES)
        .read_to_end(&mut head)
        .map_err(|e| refuse(path, format!("cannot be read ({e})")))?;
    let first_end = head.iter().position(|&b| b == b'\n');
    let first = match first_end {
        Some(i) => head.get(..i).unwrap_or(&head),
        None if (head.len() as u64) < len => {
            return Err(not_trace(format!(
                "its first line is longer than {PROBE_BYTES} bytes"
            )))
        }
        None => &head[..],
    };
    let first = std::str::from_utf8(first)
        .map_err(|_| not_trace("line 1 is not UTF-8 text".into()))?
        .trim()
        .trim_start_matches('\u{feff}');
    if !first.is_empty() {
        parse_line(first, 1, &opts).map_err(|e| not_trace(e.problem()))?;
    }
    // The end: the last complete line, and whatever follows the last newline.
    let start = len.saturating_sub(PROBE_BYTES);
    let mut tail = Vec::new();
    f.seek(SeekFrom::Start(start))
        .and_then(|_| f.read_to_end(&mut tail))
        .map_err(|e| refuse(path, format!("cannot be read ({e})")))?;
    let parse = |b: &[u8]| -> Option<f64> {
        let t = std::str::from_utf8(b).ok()?.trim();
        parse_line(t, 0, &opts).ok().map(|r| r.timestamp_ms)
    };
    let after_nl = tail.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
    let torn = tail.get(after_nl..).unwrap_or(&[]);
    let mut last = None;
    if !torn.iter().all(u8::is_ascii_whitespace) {
        match parse(torn) {
            Some(ts) => {
                last = Some(ts);
                if repair {
                    f.seek(SeekFrom::End(0))
                        .and_then(|_| f.write_all(b"\n"))
                        .map_err(|e| refuse(path, format!("cannot be written ({e})")))?;
                }
            }
            None if repair => {
                let keep = start + after_nl as u64;
                f.set_len(keep)
                    .map_err(|e| refuse(path, format!("cannot be written ({e})")))?;
                tracing::warn!(
                    "--record {}: removed a last line cut short ({} bytes; a router stopped mid-write?)",
                    path.display(),
                    torn.len()
                );
            }
            None => return Err(not_trace("its last line is cut short".into())),
        }
    }
    if last.is_none() {
        let body = tail.get(..after_nl).unwrap_or(&tail);
        let lines = body.split(|&b| b == b'\n');
        for l in lines.rev() {
            if l.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            last = Some(
                parse(l).ok_or_else(|| not_trace("its last line is not a trace record".into()))?,
            );
            break;
        }
    }
    // A whole file of blank lines: nothing to continue from.
    Ok(last.unwrap_or(0.0))
}

/// The open file and its rotation.
struct Sink {
    path: PathBuf,
    file: BufWriter<File>,
    /// Bytes in the current file.
    size: u64,
    /// Rotate when `size` reaches this (moved on after a failed rotation).
    rotate_at: u64,
    max_bytes: u64,
    keep: usize,
    stats: Arc<Stats>,
    /// A failure was reported on stderr already.
    noted: bool,
}

impl Sink {
    fn error(&mut self, what: &str, e: &std::io::Error) {
        self.stats.write_errors.fetch_add(1, Relaxed);
        if !self.noted {
            self.noted = true;
            tracing::warn!(
                "--record {}: {what} failed ({e}); records may be lost (counted as record write errors in /metrics)",
                self.path.display()
            );
        }
    }

    /// One whole line. A line that would take a non-empty file past `max_bytes` goes to a
    /// new file (the old one rotated), so every file holds at least one record and, unless a
    /// single line is longer, at most `max_bytes`.
    fn write(&mut self, line: &[u8]) -> bool {
        if self.size > 0 && self.size + line.len() as u64 > self.rotate_at {
            if let Err(e) = self.rotate() {
                self.error("rotating", &e);
                self.rotate_at = self.size + self.max_bytes;
            }
        }
        if let Err(e) = self.file.write_all(line) {
            self.error("writing", &e);
            return false;
        }
        self.size += line.len() as u64;
        true
    }

    fn flush(&mut self) {
        if let Err(e) = self.file.flush() {
            self.error("flushing", &e);
        }
    }

    /// `FILE` → `FILE.1` → … → `FILE.keep` (the oldest beyond it deleted); a new empty `FILE`.
    fn rotate(&mut self) -> std::io::Result<()> {
        self.file.flush()?;
        let ignore_missing = |r: std::io::Result<()>| match r {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        };
        if self.keep == 0 {
            std::fs::remove_file(&self.path)?;
        } else {
            ignore_missing(std::fs::remove_file(rotated(&self.path, self.keep)))?;
            for i in (1..self.keep).rev() {
                ignore_missing(std::fs::rename(
                    rotated(&self.path, i),
                    rotated(&self.path, i + 1),
                ))?;
            }
            std::fs::rename(&self.path, rotated(&self.path, 1))?;
        }
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)?;
        // The old file is closed here; its bytes were flushed above.
        self.file = BufWriter::with_capacity(64 << 10, file);
        self.size = 0;
        self.rotate_at = self.max_bytes;
        self.stats.rotations.fetch_add(1, Relaxed);
        Ok(())
    }
}

/// Puts finished records back in arrival order. Requests get consecutive sequence numbers at
/// arrival; a record is released when every earlier one has been, or when some record has
/// waited `hold` since it finished (then the earlier ones still running are given up on and
/// are released as they finish, late). Dropped records are marked gone so nothing waits for
/// them. Time is an input, so this is tested without sleeping.
struct Reorder {
    next: u64,
    /// Every held record with a sequence number up to this may be released despite gaps.
    floor: Option<u64>,
    held: BTreeMap<u64, Slot>,
    /// (when finished, sequence number), in the order received.
    arrivals: VecDeque<(Instant, u64)>,
    hold: Duration,
    max_held: usize,
}

enum Slot {
    Rec(Rec),
    Gone,
}

impl Reorder {
    fn new(hold: Duration) -> Self {
        Self {
            next: 0,
            floor: None,
            held: BTreeMap::new(),
            arrivals: VecDeque::new(),
            hold,
            max_held: MAX_HELD,
        }
    }

    fn push(&mut self, r: Rec, now: Instant, emit: &mut impl FnMut(Rec)) {
        if r.seq < self.next {
            emit(r); // late: its successors are out already
            return;
        }
        self.arrivals.push_back((now, r.seq));
        self.held.insert(r.seq, Slot::Rec(r));
    }

    fn gone(&mut self, seq: u64) {
        if seq >= self.next {
            self.held.insert(seq, Slot::Gone);
        }
    }

    fn records_held(&self) -> usize {
        self.held.len()
    }

    /// Release what may go, at time `now`; `all` releases everything held.
    fn pump(&mut self, now: Instant, all: bool, emit: &mut impl FnMut(Rec)) {
        if all {
            self.floor = Some(u64::MAX);
        }
        loop {
            while let Some(&(at, seq)) = self.arrivals.front() {
                if seq < self.next || !self.held.contains_key(&seq) {
                    self.arrivals.pop_front();
                } else if now.saturating_duration_since(at) >= self.hold {
                    self.floor = Some(self.floor.map_or(seq, |f| f.max(seq)));
                    self.arrivals.pop_front();
                } else {
                    break;
                }
            }
            if self.held.len() > self.max_held {
                if let Some((&k, _)) = self.held.first_key_value() {
                    self.floor = Some(self.floor.map_or(k, |f| f.max(k)));
                }
            }
            let mut released = false;
            while let Some(entry) = self.held.first_entry() {
                let k = *entry.key();
                if k != self.next && self.floor.is_none_or(|f| k > f) {
                    break;
                }
                self.next = k + 1;
                released = true;
                if let Slot::Rec(r) = entry.remove() {
                    emit(r);
                }
            }
            if !released || self.held.len() <= self.max_held {
                break;
            }
        }
    }
}

/// The writer thread's state.
struct Writer {
    sink: Option<Sink>,
    window: Option<Window>,
    order: Reorder,
    line: Vec<u8>,
    /// The last timestamp written (ms, on the recording's clock).
    last_ts: f64,
    /// Added to every arrival: where a continued recording left off.
    offset_ms: f64,
    stats: Arc<Stats>,
}

impl Writer {
    fn run(mut self, rx: Receiver<Msg>, gone: Arc<Mutex<Vec<u64>>>) {
        let mut last_flush = Instant::now();
        let mut dirty = false;
        loop {
            let first = rx.recv_timeout(Duration::from_millis(200));
            let now = Instant::now();
            let mut stop = false;
            let Self {
                sink,
                window,
                order,
                line,
                last_ts,
                offset_ms,
                stats,
            } = &mut self;
            let mut emit = |r: Rec| {
                let tr = write_rec(r, *offset_ms, last_ts, line, stats);
                if let Some(sink) = sink.as_mut() {
                    if sink.write(line) {
                        stats.written.fetch_add(1, Relaxed);
                        dirty = true;
                    }
                }
                if let Some(w) = window {
                    if let Ok(mut w) = w.lock() {
                        if w.len() >= WINDOW_MAX {
                            w.pop_front();
                        }
                        w.push_back(tr);
                    }
                }
            };
            let mut take = |m: Msg, order: &mut Reorder| match m {
                Msg::Rec(r) => {
                    order.push(r, now, &mut emit);
                    false
                }
                Msg::Stop => true,
            };
            match first {
                Ok(m) => {
                    stop = take(m, order);
                    while !stop {
                        match rx.try_recv() {
                            Ok(m) => stop = take(m, order),
                            Err(_) => break,
                        }
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => stop = true,
            }
            if let Ok(mut g) = gone.lock() {
                for s in g.drain(..) {
                    order.gone(s);
                }
            }
            order.pump(now, stop, &mut emit);
            stats.held.store(order.records_held() as u64, Relaxed);
            if let Some(sink) = sink.as_mut() {
                if stop || (dirty && last_flush.elapsed() >= FLUSH_EVERY) {
                    sink.flush();
                    last_flush = Instant::now();
                    dirty = false;
                }
                if stop {
                    if let Err(e) = sink.file.get_ref().sync_data() {
                        sink.error("syncing", &e);
                    }
                }
            }
            if stop {
                return;
            }
        }
    }
}

/// Encode `r` into `line`: the trace fields (`workload::trace::encode_line`), then the
/// recording's own. Keeps the file's timestamps non-decreasing. Returns the trace record.
fn write_rec(
    mut r: Rec,
    offset_ms: f64,
    last_ts: &mut f64,
    line: &mut Vec<u8>,
    stats: &Stats,
) -> TraceRecord {
    use std::io::Write as _;
    let arrival = ((offset_ms + r.arrival_ms) * 1e3).round() / 1e3;
    let ts = arrival.max(*last_ts);
    *last_ts = ts;
    let tr = TraceRecord {
        timestamp_ms: ts,
        key: format!("{:016x}", r.key),
        input_length: r.input_length,
        output_length: r.output_length,
        hash_ids: std::mem::take(&mut r.hash_ids),
        session: None,
        turn: None,
    };
    encode_line(&tr, line);
    // encode_line ends the object with "}\n": reopen it for the extra fields.
    line.truncate(line.len() - 2);
    if let Some(d) = r.destination {
        let _ = write!(line, ",\"destination\":{d}");
    }
    let _ = write!(line, ",\"status\":{}", r.status);
    if let Some(t) = r.ttft_ms {
        let _ = write!(line, ",\"ttft_ms\":{t:.1}");
    }
    let _ = write!(line, ",\"e2e_ms\":{:.1}", r.e2e_ms);
    let from = match r.output_from {
        OutputFrom::Usage => "usage",
        OutputFrom::MaxTokens => "max_tokens",
        OutputFrom::None => "none",
    };
    let _ = write!(line, ",\"output_from\":\"{from}\"");
    if !r.complete {
        line.extend_from_slice(b",\"complete\":false");
    }
    let clamped = ts - arrival;
    if clamped >= 1.0 {
        stats.late.fetch_add(1, Relaxed);
        let _ = write!(line, ",\"clamped_ms\":{clamped:.3}");
    }
    line.extend_from_slice(b"}\n");
    tr
}

#[cfg(test)]
mod tests;

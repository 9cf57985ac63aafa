//! The trace format: JSONL, one request per line, a superset of the Mooncake format.
//!
//! Fields: `timestamp` (ms from the start, non-decreasing), `key` (routing key), `input_length`,
//! `output_length`, `hash_ids` (prefix block ids; equal leading ids ⇔ equal prefix), and optional
//! `session` and `turn`. Mooncake files have no `key`: the reader derives one from the first N
//! block ids ([`ReaderOptions::key_blocks`]). Unknown fields are ignored.
//!
//! The reader streams line by line from any `BufRead` (a multi-GB file is never held whole),
//! and [`parts`] reads one file in two parts on two threads; the writer streams to any
//! `Write`. Pure: no clock, no randomness. See `docs/trace-format.md`.

use crate::bounds::JsonWhole;
use serde::{Deserialize, Serialize};
use std::borrow::Cow;
use std::io::{BufRead, Write};

/// Longest trace line, bytes (4 MiB). A request's line is its lengths and at most one block
/// id per prompt token; a prompt of `bounds::MAX_TOKENS` (2²⁰) tokens in blocks of 16 tokens
/// is 65,536 ids of at most 21 bytes each (1.4 MB). A longer line is refused as it is read,
/// before it is held whole.
pub const MAX_LINE_BYTES: usize = 4 << 20;

/// One request of a trace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TraceRecord {
    /// Milliseconds since the start of the trace.
    #[serde(rename = "timestamp")]
    pub timestamp_ms: f64,
    /// Routing / business key.
    pub key: String,
    /// Prompt tokens.
    pub input_length: u32,
    /// Generated tokens.
    pub output_length: u32,
    /// Prefix block ids, in order; two requests share a prefix of n blocks iff their first n
    /// ids are equal.
    pub hash_ids: Vec<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub turn: Option<u32>,
}

/// Errors reading a trace; each names the line (1-based) and what to do.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("line {line}: reading failed: {source}")]
    Io {
        line: usize,
        #[source]
        source: std::io::Error,
    },
    #[error("line {line}: not valid JSON ({msg}); fix the line or pass --skip-bad to skip malformed lines")]
    Json { line: usize, msg: String },
    #[error("line {line}: missing field `{field}`; every request needs timestamp, input_length, output_length and hash_ids (and key, unless derived from hash_ids)")]
    Missing { line: usize, field: &'static str },
    #[error("line {line}: field `{field}`: {msg}; fix the line or pass --skip-bad to skip it")]
    BadValue {
        line: usize,
        field: &'static str,
        msg: String,
    },
    #[error("line {line}: timestamp {ts} ms is earlier than {prev} ms on line {prev_line}; a trace must be sorted by timestamp (sort it, e.g. `sort` on the field, or pass --skip-bad)")]
    NonMonotone {
        line: usize,
        ts: f64,
        prev: f64,
        prev_line: usize,
    },
    #[error("line {line}: longer than the {MAX_LINE_BYTES} bytes a trace line may hold ({bytes} bytes); a request's line holds its lengths and at most one hash id per prompt token: fix the line or pass --skip-bad to skip it")]
    LineTooLong { line: usize, bytes: u64 },
    #[error("trace has no requests{0}; expected one JSON object per line")]
    Empty(String),
}

impl TraceError {
    /// The same error read from a part of a file that begins after its first `lines` lines
    /// (line numbers made the file's).
    pub fn shifted(self, lines: usize) -> TraceError {
        match self {
            TraceError::Io { line, source } => TraceError::Io {
                line: line + lines,
                source,
            },
            TraceError::Json { line, msg } => TraceError::Json {
                line: line + lines,
                msg,
            },
            TraceError::Missing { line, field } => TraceError::Missing {
                line: line + lines,
                field,
            },
            TraceError::BadValue { line, field, msg } => TraceError::BadValue {
                line: line + lines,
                field,
                msg,
            },
            TraceError::NonMonotone {
                line,
                ts,
                prev,
                prev_line,
            } => TraceError::NonMonotone {
                line: line + lines,
                ts,
                prev,
                prev_line: prev_line + lines,
            },
            TraceError::LineTooLong { line, bytes } => TraceError::LineTooLong {
                line: line + lines,
                bytes,
            },
            e @ TraceError::Empty(_) => e,
        }
    }

    /// What is wrong, without the advice to fix the line or pass `--skip-bad` (for a reader
    /// that has no such flag, e.g. `route --record` checking a file it would append to).
    pub fn problem(&self) -> String {
        match self {
            TraceError::Json { line, msg } => format!("line {line}: not valid JSON ({msg})"),
            TraceError::BadValue { line, field, msg } => {
                format!("line {line}: field `{field}`: {msg}")
            }
            TraceError::NonMonotone {
                line,
                ts,
                prev,
                prev_line,
            } => format!(
                "line {line}: timestamp {ts} ms is earlier than {prev} ms on line {prev_line}"
            ),
            TraceError::LineTooLong { line, bytes } => format!(
                "line {line}: longer than the {MAX_LINE_BYTES} bytes a trace line may hold ({bytes} bytes)"
            ),
            e => e.to_string(),
        }
    }

    /// The 1-based line the error is about, if any.
    pub fn line(&self) -> Option<usize> {
        match self {
            TraceError::Io { line, .. }
            | TraceError::Json { line, .. }
            | TraceError::Missing { line, .. }
            | TraceError::BadValue { line, .. }
            | TraceError::NonMonotone { line, .. }
            | TraceError::LineTooLong { line, .. } => Some(*line),
            TraceError::Empty(_) => None,
        }
    }
}

/// How to read a trace.
#[derive(Debug, Clone)]
pub struct ReaderOptions {
    /// A line without `key` gets one derived from its first `key_blocks` hash ids
    /// (`b<id0>-<id1>…`). 0 disables derivation: a missing key is then an error.
    pub key_blocks: usize,
    /// Skip (and count) malformed or invalid lines instead of stopping at the first one.
    pub skip_bad: bool,
}

impl Default for ReaderOptions {
    fn default() -> Self {
        ReaderOptions {
            key_blocks: 2,
            skip_bad: false,
        }
    }
}

/// The key derived for a keyless (Mooncake) record: `b` + its first `n` block ids joined by `-`.
pub fn derived_key(hash_ids: &[u64], n: usize) -> String {
    use std::fmt::Write as _;
    let mut s = String::from("b");
    for (i, id) in hash_ids.iter().take(n).enumerate() {
        if i > 0 {
            s.push('-');
        }
        let _ = write!(s, "{id}");
    }
    s
}

#[derive(Deserialize)]
#[serde(untagged)]
enum StrOrNum<'a> {
    #[serde(borrow)]
    S(Cow<'a, str>),
    N(serde_json::Number),
}

#[derive(Deserialize)]
struct RawRecord<'a> {
    timestamp: Option<f64>,
    #[serde(borrow)]
    key: Option<Cow<'a, str>>,
    input_length: Option<JsonWhole>,
    output_length: Option<JsonWhole>,
    hash_ids: Option<Vec<u64>>,
    #[serde(borrow)]
    session: Option<StrOrNum<'a>>,
    turn: Option<u32>,
}

fn length(line: usize, field: &'static str, v: Option<JsonWhole>) -> Result<u32, TraceError> {
    let v = v.ok_or(TraceError::Missing { line, field })?;
    let bad = |v: String| TraceError::BadValue {
        line,
        field,
        msg: format!("{v} is not a token count (a whole number in 0..=4294967295)"),
    };
    match v {
        JsonWhole::Int(n) => u32::try_from(n).map_err(|_| bad(n.to_string())),
        JsonWhole::Other(t) => Err(bad(t)),
    }
}

/// Parse one line (without validation of ordering). Public for tools that parse single lines.
///
/// Plain lines (the shape this crate writes and Mooncake's: the known fields, unescaped
/// strings, plain numbers, and other fields with plain values, as `route --record` writes)
/// take a hand-written fast path; anything else — escapes, `null` in a known field, other
/// fields holding objects or arrays, exponents, negative numbers, duplicate known fields,
/// malformed JSON — is parsed by serde_json, so results and error messages are the same
/// either way.
pub fn parse_line(
    text: &str,
    line: usize,
    opts: &ReaderOptions,
) -> Result<TraceRecord, TraceError> {
    let raw = match fast::parse(text) {
        Some(raw) => raw,
        None => parse_line_serde_raw(text, line)?,
    };
    finish_raw(raw, line, opts)
}

/// [`parse_line`] without the fast path: serde_json only (the reference the fast path is
/// tested against).
pub fn parse_line_serde(
    text: &str,
    line: usize,
    opts: &ReaderOptions,
) -> Result<TraceRecord, TraceError> {
    finish_raw(parse_line_serde_raw(text, line)?, line, opts)
}

fn parse_line_serde_raw(text: &str, line: usize) -> Result<RawRecord<'_>, TraceError> {
    serde_json::from_str(text).map_err(|e| TraceError::Json {
        line,
        msg: e.to_string(),
    })
}

fn finish_raw(
    raw: RawRecord<'_>,
    line: usize,
    opts: &ReaderOptions,
) -> Result<TraceRecord, TraceError> {
    let ts = raw.timestamp.ok_or(TraceError::Missing {
        line,
        field: "timestamp",
    })?;
    if !ts.is_finite() || ts < 0.0 {
        return Err(TraceError::BadValue {
            line,
            field: "timestamp",
            msg: format!("{ts} is negative; timestamps are ms from the start of the trace (≥ 0)"),
        });
    }
    let input_length = length(line, "input_length", raw.input_length)?;
    let output_length = length(line, "output_length", raw.output_length)?;
    let hash_ids = raw.hash_ids.ok_or(TraceError::Missing {
        line,
        field: "hash_ids",
    })?;
    if hash_ids.len() > input_length as usize {
        return Err(TraceError::BadValue {
            line,
            field: "hash_ids",
            msg: format!(
                "{} block ids for input_length {input_length}: a block holds at least one prompt token, so a request has at most input_length ids (⌈input_length / block tokens⌉)",
                hash_ids.len()
            ),
        });
    }
    let key = match raw.key {
        Some(k) => k.into_owned(),
        None if opts.key_blocks > 0 && !hash_ids.is_empty() => {
            derived_key(&hash_ids, opts.key_blocks)
        }
        None => return Err(TraceError::Missing { line, field: "key" }),
    };
    let session = raw.session.map(|s| match s {
        StrOrNum::S(s) => s.into_owned(),
        StrOrNum::N(n) => n.to_string(),
    });
    Ok(TraceRecord {
        timestamp_ms: ts,
        key,
        input_length,
        output_length,
        hash_ids,
        session,
        turn: raw.turn,
    })
}

mod fast;
pub mod parts;

/// The block ids of the same prompt in blocks `k` times larger: id j of the result stands for
/// ids `j·k … j·k + k − 1` (the last group may be shorter, like a partial block). Two prompts
/// share n coarse blocks exactly when they share their first `n·k` ids (up to 64-bit hash
/// collisions), so prefix identity is kept at the coarser granularity. `k ≤ 1` returns the ids
/// unchanged.
pub fn coarsen_hash_ids(ids: &[u64], k: usize) -> Vec<u64> {
    if k <= 1 {
        return ids.to_vec();
    }
    let mut bytes = Vec::with_capacity(8 * k);
    ids.chunks(k)
        .map(|g| {
            bytes.clear();
            for id in g {
                bytes.extend_from_slice(&id.to_le_bytes());
            }
            xxhash_rust::xxh3::xxh3_64_with_seed(&bytes, g.len() as u64)
        })
        .collect()
}

/// Streaming reader: an iterator over the records of a JSONL trace, validating each line and
/// the timestamp order. After a fatal error it yields nothing more. An input without a single
/// record yields [`TraceError::Empty`].
pub struct TraceReader<R: BufRead> {
    reader: R,
    opts: ReaderOptions,
    buf: Vec<u8>,
    line: usize,
    prev_ts: f64,
    prev_line: usize,
    records: usize,
    skipped: usize,
    first_skipped: Vec<(usize, String)>,
    done: bool,
}

impl<R: BufRead> TraceReader<R> {
    pub fn new(reader: R, opts: ReaderOptions) -> Self {
        TraceReader {
            reader,
            opts,
            buf: Vec::new(),
            line: 0,
            prev_ts: 0.0,
            prev_line: 0,
            records: 0,
            skipped: 0,
            first_skipped: Vec::new(),
            done: false,
        }
    }

    /// Lines skipped so far (only with `skip_bad`).
    pub fn skipped(&self) -> usize {
        self.skipped
    }

    /// The first few skipped lines with their error, for reporting.
    pub fn first_skipped(&self) -> &[(usize, String)] {
        &self.first_skipped
    }

    /// Records yielded so far.
    pub fn records(&self) -> usize {
        self.records
    }

    /// The number of the last line read.
    pub fn line(&self) -> usize {
        self.line
    }

    fn next_inner(&mut self) -> Option<Result<TraceRecord, TraceError>> {
        loop {
            let too_long = match read_line_capped(&mut self.reader, &mut self.buf) {
                Ok(None) => {
                    if self.records == 0 {
                        let why = if self.skipped > 0 {
                            format!(" ({} line(s) skipped as bad)", self.skipped)
                        } else {
                            String::new()
                        };
                        return Some(Err(TraceError::Empty(why)));
                    }
                    return None;
                }
                Ok(Some(too_long)) => too_long,
                Err(source) => {
                    return Some(Err(TraceError::Io {
                        line: self.line + 1,
                        source,
                    }))
                }
            };
            self.line += 1;
            let text = match (too_long, std::str::from_utf8(&self.buf)) {
                (Some(bytes), _) => Err(TraceError::LineTooLong {
                    line: self.line,
                    bytes,
                }),
                (None, Ok(t)) => Ok(t.trim()),
                (None, Err(_)) => {
                    return Some(Err(TraceError::Io {
                        line: self.line,
                        source: std::io::Error::new(
                            std::io::ErrorKind::InvalidData,
                            "stream did not contain valid UTF-8",
                        ),
                    }))
                }
            };
            let text = match text {
                Ok(t) => t,
                Err(e) if self.opts.skip_bad => {
                    self.skipped += 1;
                    if self.first_skipped.len() < 5 {
                        self.first_skipped.push((self.line, e.to_string()));
                    }
                    continue;
                }
                Err(e) => return Some(Err(e)),
            };
            let text = if self.line == 1 {
                text.trim_start_matches('\u{feff}')
            } else {
                text
            };
            if text.is_empty() {
                continue;
            }
            let parsed = parse_line(text, self.line, &self.opts).and_then(|r| {
                if r.timestamp_ms < self.prev_ts {
                    Err(TraceError::NonMonotone {
                        line: self.line,
                        ts: r.timestamp_ms,
                        prev: self.prev_ts,
                        prev_line: self.prev_line,
                    })
                } else {
                    Ok(r)
                }
            });
            match parsed {
                Ok(r) => {
                    self.prev_ts = r.timestamp_ms;
                    self.prev_line = self.line;
                    self.records += 1;
                    return Some(Ok(r));
                }
                Err(e) if self.opts.skip_bad => {
                    self.skipped += 1;
                    if self.first_skipped.len() < 5 {
                        self.first_skipped.push((self.line, e.to_string()));
                    }
                }
                Err(e) => return Some(Err(e)),
            }
        }
    }
}

/// Read one line into `buf` (its newline included), never holding more than
/// [`MAX_LINE_BYTES`] of it: `None` at the end of the input; `Some(Some(bytes))` for a longer
/// line, read to its end without keeping it (`buf` is then empty); `Some(None)` otherwise.
fn read_line_capped<R: BufRead>(
    r: &mut R,
    buf: &mut Vec<u8>,
) -> std::io::Result<Option<Option<u64>>> {
    buf.clear();
    let mut read = 0u64;
    let mut too_long = false;
    let mut newline = false;
    loop {
        let avail = match r.fill_buf() {
            Ok(a) => a,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if avail.is_empty() {
            break;
        }
        let (take, done) = match avail.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (avail.len(), false),
        };
        read += take as u64;
        let content = read - done as u64;
        if !too_long && content > MAX_LINE_BYTES as u64 {
            too_long = true;
            buf.clear();
            buf.shrink_to(1 << 16);
        }
        if !too_long {
            buf.extend_from_slice(&avail[..take]);
        }
        r.consume(take);
        if done {
            newline = true;
            break;
        }
    }
    if read == 0 {
        return Ok(None);
    }
    Ok(Some(too_long.then_some(read - newline as u64)))
}

impl<R: BufRead> Iterator for TraceReader<R> {
    type Item = Result<TraceRecord, TraceError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        let item = self.next_inner();
        if !matches!(item, Some(Ok(_))) {
            self.done = true;
        }
        item
    }
}

/// Streaming writer of trace lines.
pub struct TraceWriter<W: Write> {
    w: W,
    written: usize,
    line: Vec<u8>,
}

impl<W: Write> TraceWriter<W> {
    pub fn new(w: W) -> Self {
        TraceWriter {
            w,
            written: 0,
            line: Vec::with_capacity(1024),
        }
    }

    /// Write one record as one line.
    pub fn write(&mut self, r: &TraceRecord) -> std::io::Result<()> {
        encode_line(r, &mut self.line);
        self.w.write_all(&self.line)?;
        self.written += 1;
        Ok(())
    }

    /// Records written so far.
    pub fn written(&self) -> usize {
        self.written
    }

    /// Flush and return the inner writer.
    pub fn finish(mut self) -> std::io::Result<W> {
        self.w.flush()?;
        Ok(self.w)
    }
}

/// Encode one record as a JSON line (with the trailing newline) into `out` (cleared first).
/// Integral timestamps are written without a fraction, as Mooncake does.
pub fn encode_line(r: &TraceRecord, out: &mut Vec<u8>) {
    use std::io::Write as _;
    out.clear();
    let ts = r.timestamp_ms;
    if ts.fract() == 0.0 && ts.abs() < 9.0e15 {
        let _ = write!(out, "{{\"timestamp\":{}", ts as i64);
    } else {
        let _ = write!(out, "{{\"timestamp\":{ts:.3}");
    }
    out.extend_from_slice(b",\"key\":");
    let _ = serde_json::to_writer(&mut *out, &r.key);
    let _ = write!(
        out,
        ",\"input_length\":{},\"output_length\":{},\"hash_ids\":[",
        r.input_length, r.output_length
    );
    let mut ibuf = itoa_buf();
    for (i, id) in r.hash_ids.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(fmt_u64(*id, &mut ibuf));
    }
    out.push(b']');
    if let Some(s) = &r.session {
        out.extend_from_slice(b",\"session\":");
        let _ = serde_json::to_writer(&mut *out, s);
    }
    if let Some(t) = r.turn {
        let _ = write!(out, ",\"turn\":{t}");
    }
    out.extend_from_slice(b"}\n");
}

fn itoa_buf() -> [u8; 20] {
    [0u8; 20]
}

/// `v` in decimal ASCII digits, written into the end of `buf`.
pub(crate) fn fmt_u64(mut v: u64, buf: &mut [u8; 20]) -> &[u8] {
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    &buf[i..]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coarsened_ids_keep_prefix_identity() {
        let a = [1, 2, 3, 4, 5, 6, 7];
        let b = [1, 2, 3, 4, 5, 9, 7];
        let (ca, cb) = (coarsen_hash_ids(&a, 4), coarsen_hash_ids(&b, 4));
        assert_eq!(ca.len(), 2);
        assert_eq!(ca[0], cb[0]); // the first 4 ids agree
        assert_ne!(ca[1], cb[1]); // the partial group differs
                                  // A shorter prompt with the same leading ids shares the full groups only.
        let c = coarsen_hash_ids(&a[..6], 4);
        assert_eq!(c[0], ca[0]);
        assert_ne!(c[1], ca[1]);
        assert_eq!(coarsen_hash_ids(&a, 1), a.to_vec());
        assert!(coarsen_hash_ids(&[], 4).is_empty());
    }

    fn read_all(text: &str, opts: ReaderOptions) -> Result<Vec<TraceRecord>, TraceError> {
        TraceReader::new(text.as_bytes(), opts).collect()
    }

    #[test]
    fn roundtrip() {
        let r = TraceRecord {
            timestamp_ms: 12.5,
            key: "a\"b".into(),
            input_length: 40,
            output_length: 3,
            hash_ids: vec![0, 7, u64::MAX],
            session: Some("s1".into()),
            turn: Some(2),
        };
        let r2 = TraceRecord {
            timestamp_ms: 13.0,
            session: None,
            turn: None,
            ..r.clone()
        };
        let mut w = TraceWriter::new(Vec::new());
        w.write(&r).unwrap();
        w.write(&r2).unwrap();
        let bytes = w.finish().unwrap();
        let text = String::from_utf8(bytes).unwrap();
        assert!(text.contains("\"timestamp\":13,"), "{text}");
        let back = read_all(&text, ReaderOptions::default()).unwrap();
        assert_eq!(back, vec![r, r2]);
    }

    #[test]
    fn mooncake_lines_get_derived_keys() {
        let text = "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 5, \"hash_ids\": [0, 14, 15]}\n\
                    {\"timestamp\": 3000, \"input_length\": 100, \"output_length\": 5, \"hash_ids\": [0]}\n";
        let v = read_all(text, ReaderOptions::default()).unwrap();
        assert_eq!(v[0].key, "b0-14");
        assert_eq!(v[1].key, "b0");
        let e = read_all(
            text,
            ReaderOptions {
                key_blocks: 0,
                skip_bad: false,
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("line 1: missing field `key`"), "{e}");
    }

    #[test]
    fn errors_name_lines_and_fields() {
        let good = "{\"timestamp\":1,\"key\":\"a\",\"input_length\":1,\"output_length\":1,\"hash_ids\":[1]}";
        let e = |t: &str| read_all(t, ReaderOptions::default()).unwrap_err();
        let bad_json = format!("{good}\n{{oops\n");
        let err = e(&bad_json);
        assert_eq!(err.line(), Some(2));
        assert!(err.to_string().contains("--skip-bad"));
        assert!(e("").to_string().contains("no requests"));
        assert!(e("\n\n").to_string().contains("no requests"));
        let missing = "{\"timestamp\":1,\"key\":\"a\",\"output_length\":1,\"hash_ids\":[1]}";
        assert!(e(missing)
            .to_string()
            .contains("line 1: missing field `input_length`"));
        let neg = good.replace("\"timestamp\":1", "\"timestamp\":-5");
        assert!(e(&neg).to_string().contains("negative"));
        let early = good.replace("\"timestamp\":1", "\"timestamp\":0.5");
        let err = e(&format!("{good}\n{early}\n"));
        assert!(
            err.to_string()
                .contains("line 2: timestamp 0.5 ms is earlier than 1 ms on line 1"),
            "{err}"
        );
        let neg_len = good.replace("\"input_length\":1", "\"input_length\":-1");
        assert!(e(&neg_len).to_string().contains("`input_length`"));
    }

    #[test]
    fn a_line_over_the_cap_is_refused_as_it_is_read() {
        let good = "{\"timestamp\":1,\"key\":\"a\",\"input_length\":1,\"output_length\":1,\"hash_ids\":[1]}";
        // Just over the cap, then a good line: refused naming the line and its size.
        let long = format!("{}\n{good}\n", "x".repeat(MAX_LINE_BYTES + 1));
        let e = read_all(&long, ReaderOptions::default()).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("line 1: longer than the {MAX_LINE_BYTES} bytes a trace line may hold ({} bytes); a request's line holds its lengths and at most one hash id per prompt token: fix the line or pass --skip-bad to skip it", MAX_LINE_BYTES + 1)
        );
        // With --skip-bad it is skipped and counted, and reading goes on.
        let mut rd = TraceReader::new(
            long.as_bytes(),
            ReaderOptions {
                skip_bad: true,
                ..ReaderOptions::default()
            },
        );
        assert_eq!(rd.by_ref().filter_map(Result::ok).count(), 1);
        assert_eq!(rd.skipped(), 1);
        // At the cap (CRLF ending and all) it is read, and judged as JSON.
        let at = format!("{}\r\n{good}", "x".repeat(MAX_LINE_BYTES - 1));
        let e = read_all(&at, ReaderOptions::default()).unwrap_err();
        assert!(e.to_string().starts_with("line 1: not valid JSON"), "{e}");
        // A long line through a small buffer, as a file is read.
        let rd = TraceReader::new(
            std::io::BufReader::with_capacity(7, long.as_bytes()),
            ReaderOptions::default(),
        );
        let e = rd.into_iter().next().unwrap().unwrap_err();
        assert!(
            matches!(e, TraceError::LineTooLong { line: 1, bytes } if bytes == MAX_LINE_BYTES as u64 + 1),
            "{e}"
        );
    }

    #[test]
    fn more_block_ids_than_prompt_tokens_are_refused_naming_the_field() {
        let line = "{\"timestamp\":1,\"key\":\"a\",\"input_length\":2,\"output_length\":1,\"hash_ids\":[1,2,3]}";
        for e in [
            parse_line(line, 4, &ReaderOptions::default()).unwrap_err(),
            parse_line_serde(line, 4, &ReaderOptions::default()).unwrap_err(),
        ] {
            assert_eq!(
                e.to_string(),
                "line 4: field `hash_ids`: 3 block ids for input_length 2: a block holds at least one prompt token, so a request has at most input_length ids (⌈input_length / block tokens⌉); fix the line or pass --skip-bad to skip it"
            );
        }
        let ok = line.replace("[1,2,3]", "[1,2]");
        assert!(parse_line(&ok, 1, &ReaderOptions::default()).is_ok());
    }

    #[test]
    fn a_length_that_is_no_token_count_names_the_field() {
        let good = "{\"timestamp\":1,\"key\":\"a\",\"input_length\":1,\"output_length\":1,\"hash_ids\":[1]}";
        for (v, shown) in [
            ("1e308", "1e308"),
            ("1.5", "1.5"),
            ("-1", "-1"),
            ("4294967296", "4294967296"),
            ("18446744073709551615", "18446744073709551615"),
            ("\"7\"", "\"7\""),
            ("[1]", "an array"),
        ] {
            let line = good.replace("\"input_length\":1", &format!("\"input_length\":{v}"));
            let e = parse_line(&line, 3, &ReaderOptions::default()).unwrap_err();
            assert_eq!(
                e.to_string(),
                format!("line 3: field `input_length`: {shown} is not a token count (a whole number in 0..=4294967295); fix the line or pass --skip-bad to skip it"),
                "{v}"
            );
            assert_eq!(
                e.problem(),
                format!("line 3: field `input_length`: {shown} is not a token count (a whole number in 0..=4294967295)")
            );
        }
        let e = parse_line("{x", 2, &ReaderOptions::default()).unwrap_err();
        assert!(e.to_string().contains("--skip-bad"));
        assert!(!e.problem().contains("--skip-bad"), "{}", e.problem());
    }

    #[test]
    fn skip_bad_counts() {
        let good = "{\"timestamp\":1,\"key\":\"a\",\"input_length\":1,\"output_length\":1,\"hash_ids\":[1]}";
        let text = format!("{good}\nnot json\n{good}\n{{\"timestamp\":0}}\n");
        let mut rd = TraceReader::new(
            text.as_bytes(),
            ReaderOptions {
                key_blocks: 2,
                skip_bad: true,
            },
        );
        let v: Vec<_> = rd.by_ref().collect::<Result<_, _>>().unwrap();
        assert_eq!(v.len(), 2);
        assert_eq!(rd.skipped(), 2);
        assert_eq!(rd.first_skipped()[0].0, 2);
        assert_eq!(rd.first_skipped()[1].0, 4);
        let all_bad = "x\ny\n";
        let err = TraceReader::new(
            all_bad.as_bytes(),
            ReaderOptions {
                key_blocks: 2,
                skip_bad: true,
            },
        )
        .collect::<Result<Vec<_>, _>>()
        .unwrap_err();
        assert!(err.to_string().contains("2 line(s) skipped"), "{err}");
    }

    /// Lines with other plain fields (what `route --record` writes) stay on the fast path.
    #[test]
    fn other_plain_fields_take_the_fast_path() {
        let rec = r#"{"timestamp":2044.631,"key":"d1f945ef65f45132","input_length":5,"output_length":5,"hash_ids":[1],"destination":1,"status":200,"ttft_ms":4.6,"e2e_ms":4.6,"output_from":"usage","complete":false,"clamped_ms":12.250}"#;
        let raw = fast::parse(rec).expect("fast path");
        assert_eq!(raw.input_length, Some(JsonWhole::Int(5)));
        for other in [r#""x":[1]"#, r#""x":{}"#, r#""x":-1"#, r#""x":"\n""#] {
            let line = format!(
                r#"{{"timestamp":1,"key":"k","input_length":1,"output_length":1,"hash_ids":[1],{other}}}"#
            );
            assert!(fast::parse(&line).is_none(), "{line}");
        }
    }

    /// The fast path and serde_json agree on every line: same record or the same error text.
    #[test]
    fn fast_parser_matches_serde() {
        let lines = [
            r#"{"timestamp":1.415,"key":"k033276","input_length":950,"output_length":183,"hash_ids":[3564178965726031175,17518540451494168230],"session":"e9fd6049d65af21e","turn":1}"#,
            r#"{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 14, 15]}"#,
            "{ \"timestamp\" :\t12 ,\r\"key\": \"a b\" , \"input_length\":0,\"output_length\":0,\"hash_ids\":[ ] } ",
            r#"{"timestamp":2.710,"key":"k","input_length":1,"output_length":1,"hash_ids":[18446744073709551615]}"#,
            r#"{"timestamp":123456789.123456,"key":"k","input_length":1,"output_length":1,"hash_ids":[1]}"#,
            r#"{"timestamp":0.1,"key":"k","input_length":1,"output_length":1,"hash_ids":[1]}"#,
            r#"{"timestamp":3.0000000000001,"key":"k","input_length":1,"output_length":1,"hash_ids":[1]}"#,
            r#"{"timestamp":1e3,"key":"k","input_length":1,"output_length":1,"hash_ids":[1]}"#,
            r#"{"timestamp":1.5E-2,"key":"k","input_length":1,"output_length":1,"hash_ids":[1]}"#,
            r#"{"timestamp":-0,"key":"k","input_length":1,"output_length":1,"hash_ids":[1]}"#,
            r#"{"timestamp":-5,"key":"k","input_length":1,"output_length":1,"hash_ids":[1]}"#,
            r#"{"timestamp":1,"key":"a\"b\\c\u00e9\n","input_length":1,"output_length":1,"hash_ids":[1]}"#,
            r#"{"timestamp":1,"key":"ключ","input_length":1,"output_length":1,"hash_ids":[1],"session":"s\tx"}"#,
            r#"{"timestamp":1,"key":"k","input_length":1,"output_length":1,"hash_ids":[1],"session":42,"turn":3}"#,
            r#"{"timestamp":1,"key":"k","input_length":1,"output_length":1,"hash_ids":[1],"session":null,"turn":null}"#,
            r#"{"timestamp":1,"key":"k","input_length":1,"output_length":1,"hash_ids":[1],"extra":{"a":[1,2]}}"#,
            r#"{"timestamp":1,"key":"k","key":"j","input_length":1,"output_length":1,"hash_ids":[1]}"#,
            r#"{"timestamp":1,"key":"k","input_length":4294967296,"output_length":1,"hash_ids":[1]}"#,
            r#"{"timestamp":1,"key":"k","input_length":-1,"output_length":1,"hash_ids":[1]}"#,
            r#"{"timestamp":1,"key":"k","input_length":1.0,"output_length":1,"hash_ids":[1]}"#,
            r#"{"timestamp":1,"key":"k","input_length":01,"output_length":1,"hash_ids":[1]}"#,
            r#"{"timestamp":1,"key":"k","input_length":1,"output_length":1,"hash_ids":[18446744073709551616]}"#,
            r#"{"timestamp":1,"key":"k","input_length":1,"output_length":1,"hash_ids":[1,]}"#,
            r#"{"timestamp":1,"key":"k","input_length":1,"output_length":1,"hash_ids":[1 2]}"#,
            r#"{"timestamp":1,"key":"k","input_length":1,"output_length":1,"hash_ids":[1],"turn":4294967296}"#,
            r#"{"timestamp":1,"key":"k","input_length":1,"output_length":1}"#,
            r#"{"timestamp":1,"input_length":1,"output_length":1,"hash_ids":[]}"#,
            r#"{"key":"k","input_length":1,"output_length":1,"hash_ids":[1]}"#,
            r#"{"timestamp":1.,"key":"k","input_length":1,"output_length":1,"hash_ids":[1]}"#,
            r#"{"timestamp":1,"key":"k","input_length":1,"output_length":1,"hash_ids":[1]} x"#,
            r#"{"timestamp":1,"key":"k","input_length":1,"output_length":1,"hash_ids":[1]"#,
            r#"{"timestamp":1,"key":"k""input_length":1}"#,
            r#"{}"#,
            r#"[1,2]"#,
            "not json",
            r#"{"timestamp":1,"ke\u0079":"k","input_length":1,"output_length":1,"hash_ids":[1]}"#,
            // Other fields: skipped when plain, else left to serde_json; same answer.
            r#"{"timestamp":2044.631,"key":"d1f945ef65f45132","input_length":5,"output_length":5,"hash_ids":[14596051214287542811],"destination":1,"status":200,"ttft_ms":4.6,"e2e_ms":4.6,"output_from":"usage","complete":false,"clamped_ms":12.250}"#,
            r#"{"x":true,"timestamp":1,"y":null,"key":"k","z":false,"input_length":1,"output_length":1,"hash_ids":[1],"w":0}"#,
            r#"{"timestamp":1,"key":"k","input_length":1,"output_length":1,"hash_ids":[1],"x":1,"x":"again"}"#,
            r#"{"timestamp":1,"key":"k","input_length":1,"output_length":1,"hash_ids":[1],"x":99999999999999999999}"#,
            r#"{"timestamp":1,"key":"k","input_length":1,"output_length":1,"hash_ids":[1],"x":0.000}"#,
            r#"{"timestamp":1,"key":"k","input_length":1,"output_length":1,"hash_ids":[1],"x":1.}"#,
            r#"{"timestamp":1,"key":"k","input_length":1,"output_length":1,"hash_ids":[1],"x":.5}"#,
            r#"{"timestamp":1,"key":"k","input_length":1,"output_length":1,"hash_ids":[1],"x":01}"#,
            r#"{"timestamp":1,"key":"k","input_length":1,"output_length":1,"hash_ids":[1],"x":-1}"#,
            r#"{"timestamp":1,"key":"k","input_length":1,"output_length":1,"hash_ids":[1],"x":1e5}"#,
            r#"{"timestamp":1,"key":"k","input_length":1,"output_length":1,"hash_ids":[1],"x":1.5E+2}"#,
            r#"{"timestamp":1,"key":"k","input_length":1,"output_length":1,"hash_ids":[1],"x":tru}"#,
            r#"{"timestamp":1,"key":"k","input_length":1,"output_length":1,"hash_ids":[1],"x":truex}"#,
            r#"{"timestamp":1,"key":"k","input_length":1,"output_length":1,"hash_ids":[1],"x":nul}"#,
            r#"{"timestamp":1,"key":"k","input_length":1,"output_length":1,"hash_ids":[1],"x":"a\"b"}"#,
            r#"{"timestamp":1,"key":"k","input_length":1,"output_length":1,"hash_ids":[1],"x":"é"}"#,
            r#"{"timestamp":1,"key":"k","input_length":1,"output_length":1,"hash_ids":[1],"x":[1,2]}"#,
            r#"{"timestamp":1,"key":"k","input_length":1,"output_length":1,"hash_ids":[1],"x":}"#,
            r#"{"timestamp":1,"key":"k","input_length":1,"output_length":1,"hash_ids":[1],"x" 1}"#,
            r#"{"timestamp":1,"key":"k","input_length":1,"output_length":1,"hash_ids":[1],"x":1 2}"#,
            r#"{"timestamp":1,"key":"k","input_length":1,"output_length":1,"x":"hash_ids","hash_ids":[1]}"#,
        ];
        let mut all: Vec<String> = lines.iter().map(|s| s.to_string()).collect();
        // Timestamps with 1–15 significant digits: the fast path must round as serde does.
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        for _ in 0..2000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let digits = 1 + (x % 15) as u32;
            let v = (x >> 8) % 10u64.pow(digits);
            let frac = ((x >> 4) % (digits as u64 + 1)) as usize;
            let mut t = format!("{v:0w$}", w = frac + 1);
            if frac > 0 {
                t.insert(t.len() - frac, '.');
            }
            all.push(format!(
                r#"{{"timestamp":{t},"key":"k","input_length":1,"output_length":1,"hash_ids":[{x}]}}"#
            ));
        }
        for (n, text) in all.iter().enumerate() {
            for key_blocks in [0, 2] {
                let opts = ReaderOptions {
                    key_blocks,
                    skip_bad: false,
                };
                let fast = parse_line(text, n + 1, &opts).map_err(|e| e.to_string());
                let slow = parse_line_serde(text, n + 1, &opts).map_err(|e| e.to_string());
                match (&fast, &slow) {
                    (Ok(a), Ok(b)) => assert!(
                        a == b && a.timestamp_ms.to_bits() == b.timestamp_ms.to_bits(),
                        "{text}: {a:?} vs {b:?}"
                    ),
                    _ => assert_eq!(fast, slow, "{text}"),
                }
            }
        }
        // Through the reader: bad lines give the same line-numbered errors.
        let text = format!("{}\n\n{}\n{}\n", lines[0], lines[3], lines[18]);
        let err = read_all(&text, ReaderOptions::default()).unwrap_err();
        assert_eq!(err.line(), Some(4));
        assert!(err.to_string().contains("`input_length`"), "{err}");
    }
}

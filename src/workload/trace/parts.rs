//! One trace file read in two parts on two threads: the file is split at a line boundary
//! ([`line_boundary`]), each part is read by its own [`TraceReader`] and folded into the
//! caller's accumulator, errors name the file's lines as a single reader's would, and the
//! timestamp order is checked across the split ([`read_in_two`]). The caller joins the two
//! accumulators (statistics: `workload::stats::StatsAcc::join`). Not with
//! [`ReaderOptions::skip_bad`]: skipping an out-of-order line needs the line before it, which
//! the second part has not read.

use super::{ReaderOptions, TraceError, TraceReader, TraceRecord};
use std::io::{BufRead, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// Why a trace file could not be read in parts; lines are the file's.
#[derive(Debug, thiserror::Error)]
pub enum PartsError {
    /// The file would not open.
    #[error("cannot open {}", path.display())]
    Open {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// Seeking in the file or reading it failed.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// A line is not a record the reader takes, or a timestamp goes back.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// The caller's fold refused the record on `line`, in `msg`'s words.
    #[error("line {line}: {msg}")]
    Refused { line: usize, msg: String },
}

impl PartsError {
    /// The error of a part that begins after `lines` lines of the file, its line made the
    /// file's.
    fn shifted(self, lines: usize) -> PartsError {
        match self {
            PartsError::Trace(e) => PartsError::Trace(e.shifted(lines)),
            PartsError::Refused { line, msg } => PartsError::Refused {
                line: line + lines,
                msg,
            },
            e => e,
        }
    }
}

/// Open the file, naming it if it will not open.
fn open(path: &Path) -> Result<std::fs::File, PartsError> {
    std::fs::File::open(path).map_err(|source| PartsError::Open {
        path: path.to_path_buf(),
        source,
    })
}

/// The offset just after the first newline at or after `from`, if any.
pub fn line_boundary(path: &Path, from: u64) -> Result<Option<u64>, PartsError> {
    let mut f = open(path)?;
    f.seek(SeekFrom::Start(from))?;
    let mut r = std::io::BufReader::new(f);
    let mut buf = Vec::new();
    let n = r.read_until(b'\n', &mut buf)?;
    Ok((n > 0 && buf.last() == Some(&b'\n')).then_some(from + n as u64))
}

/// One part of a trace file, read.
struct Part<A> {
    acc: A,
    /// Lines in the part.
    lines: usize,
    /// Timestamp and line (within the part) of its first and last record.
    first: Option<(f64, usize)>,
    last: Option<(f64, usize)>,
}

/// Read `len` bytes of the trace from `start` (whole lines) into `acc`; errors name the line
/// within the part.
fn read_part<A>(
    path: &Path,
    read: &ReaderOptions,
    mut acc: A,
    add: &impl Fn(&mut A, &TraceRecord) -> Result<(), String>,
    start: u64,
    len: u64,
) -> Result<Part<A>, PartsError> {
    let mut f = open(path)?;
    f.seek(SeekFrom::Start(start))?;
    let mut rd = TraceReader::new(
        std::io::BufReader::with_capacity(1 << 20, f.take(len)),
        read.clone(),
    );
    let (mut first, mut last) = (None, None);
    loop {
        match rd.next() {
            None => break,
            Some(Ok(r)) => {
                if let Err(msg) = add(&mut acc, &r) {
                    return Err(PartsError::Refused {
                        line: rd.line(),
                        msg,
                    });
                }
                first.get_or_insert((r.timestamp_ms, rd.line()));
                last = Some((r.timestamp_ms, rd.line()));
            }
            // A part may hold no record (the other one does, or the whole trace is empty).
            Some(Err(TraceError::Empty(_))) => break,
            Some(Err(e)) => return Err(PartsError::Trace(e)),
        }
    }
    Ok(Part {
        acc,
        lines: rd.line(),
        first,
        last,
    })
}

/// Read the trace file at `path`, `size` bytes, in two parts on two threads split at byte
/// `split` (a line boundary: [`line_boundary`]). Each part's records are folded in order into
/// an accumulator made by `new`, by `add`, which refuses a record with an `Err` of its own
/// words (given back with the record's line, [`PartsError::Refused`]). Returns the two
/// accumulators, the first part's first. Errors name the file's lines: the first part's error
/// comes first, then the second's, then a timestamp across the split earlier than the one
/// before it; a file without a record is [`TraceError::Empty`].
pub fn read_in_two<A: Send>(
    path: &Path,
    read: &ReaderOptions,
    split: u64,
    size: u64,
    new: impl Fn() -> A + Sync,
    add: impl Fn(&mut A, &TraceRecord) -> Result<(), String> + Sync,
) -> Result<(A, A), PartsError> {
    let (a, b) = std::thread::scope(|sc| {
        let first = sc.spawn(|| read_part(path, read, new(), &add, 0, split));
        let second = read_part(path, read, new(), &add, split, size.saturating_sub(split));
        (first.join().expect("reader thread"), second)
    });
    let a = a?;
    let b = b.map_err(|e| e.shifted(a.lines))?;
    // The order across the parts.
    if let (Some((prev, prev_line)), Some((ts, line))) = (a.last, b.first) {
        if ts < prev {
            return Err(TraceError::NonMonotone {
                line: a.lines + line,
                ts,
                prev,
                prev_line,
            }
            .into());
        }
    }
    if a.first.is_none() && b.first.is_none() {
        return Err(TraceError::Empty(String::new()).into());
    }
    Ok((a.acc, b.acc))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A trace of `n` lines, key k{i % 5}, 10 ms apart, with `bad` lines replaced (also the
    /// advise tests').
    pub(crate) fn trace_file(dir: &Path, n: usize, bad: &[(usize, &str)]) -> PathBuf {
        let mut t = String::new();
        for i in 1..=n {
            match bad.iter().find(|b| b.0 == i) {
                Some((_, l)) => t.push_str(l),
                None => t.push_str(&format!(
                    "{{\"timestamp\":{},\"key\":\"k{}\",\"input_length\":{},\"output_length\":5,\"hash_ids\":[{},{}]}}",
                    i * 10,
                    i % 5,
                    100 + i % 13,
                    i % 5,
                    i
                )),
            }
            t.push('\n');
        }
        let p = dir.join("t.jsonl");
        std::fs::write(&p, t).unwrap();
        p
    }

    /// The fold of the tests: keep the records, refuse an input over a million tokens.
    fn keep(v: &mut Vec<TraceRecord>, r: &TraceRecord) -> Result<(), String> {
        if r.input_length > 1_000_000 {
            return Err(format!("input_length {} is too long", r.input_length));
        }
        v.push(r.clone());
        Ok(())
    }

    type Records = Result<Vec<TraceRecord>, String>;

    /// The file read by one reader, and in two parts split at its middle line boundary.
    fn both_ways(path: &Path) -> (Records, Records) {
        let mut one = Vec::new();
        let mut rd = TraceReader::new(
            std::io::BufReader::new(std::fs::File::open(path).unwrap()),
            ReaderOptions::default(),
        );
        let one = loop {
            match rd.next() {
                None => break Ok(one),
                Some(Err(e)) => break Err(e.to_string()),
                Some(Ok(r)) => {
                    if let Err(msg) = keep(&mut one, &r) {
                        break Err(format!("line {}: {msg}", rd.line()));
                    }
                }
            }
        };
        let size = std::fs::metadata(path).unwrap().len();
        let split = line_boundary(path, size / 2).unwrap().unwrap();
        assert!(split < size);
        let two = read_in_two(path, &ReaderOptions::default(), split, size, Vec::new, keep)
            .map(|(mut a, b)| {
                a.extend(b);
                a
            })
            .map_err(|e| e.to_string());
        (one, two)
    }

    #[test]
    fn a_trace_read_in_two_parts_gives_the_records_of_one_reader() {
        let dir = tempfile::tempdir().unwrap();
        let p = trace_file(dir.path(), 1001, &[]);
        let (a, b) = both_ways(&p);
        let a = a.unwrap();
        assert_eq!(a.len(), 1001);
        assert_eq!(a, b.unwrap());
    }

    #[test]
    fn errors_in_the_second_part_name_the_file_line() {
        let dir = tempfile::tempdir().unwrap();
        // A malformed line late in the file, and a request the fold refuses.
        for (bad, want) in [
            ((900, "{\"timestamp\": oops"), "line 900: not valid JSON"),
            (
                (
                    950,
                    "{\"timestamp\":9500,\"key\":\"x\",\"input_length\":5000000,\"output_length\":5,\"hash_ids\":[1]}",
                ),
                "line 950: input_length 5000000",
            ),
        ] {
            let p = trace_file(dir.path(), 1000, &[bad]);
            let (a, b) = both_ways(&p);
            for e in [a.unwrap_err(), b.unwrap_err()] {
                assert!(e.contains(want), "{e}");
            }
        }
        // Out of order exactly across the split: the first line of the second part goes back
        // to 0 ms (padded to the same length, so the split stays where it was).
        let p = trace_file(dir.path(), 1000, &[]);
        let bytes = std::fs::read(&p).unwrap();
        let split = line_boundary(&p, bytes.len() as u64 / 2).unwrap().unwrap() as usize;
        let n = bytes[..split].iter().filter(|&&c| c == b'\n').count() + 1;
        let text = String::from_utf8(bytes).unwrap();
        let old = text.lines().nth(n - 1).unwrap().to_string();
        let mut new = "{\"timestamp\":0,\"key\":\"x\",\"input_length\":5,\"output_length\":5,\"hash_ids\":[1]}".to_string();
        assert!(new.len() <= old.len());
        new.push_str(&" ".repeat(old.len() - new.len()));
        let line = format!("line {n}: timestamp 0 ms");
        let p = trace_file(dir.path(), 1000, &[(n, new.as_str())]);
        let (a, b) = both_ways(&p);
        for e in [a.unwrap_err(), b.unwrap_err()] {
            assert!(e.contains(&line), "{e}");
        }
        // Out of order across the parts: line 600 goes back to 0 ms.
        let p = trace_file(
            dir.path(),
            1000,
            &[(
                600,
                "{\"timestamp\":0,\"key\":\"x\",\"input_length\":5,\"output_length\":5,\"hash_ids\":[1]}",
            )],
        );
        let (a, b) = both_ways(&p);
        for e in [a.unwrap_err(), b.unwrap_err()] {
            assert!(e.contains("line 600: timestamp 0 ms"), "{e}");
        }
    }
}

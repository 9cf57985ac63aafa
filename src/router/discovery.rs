//! Discovery without restarts: the backends file (`backends_file`), watched while routing.
//!
//! The file holds one backend base URL a line; blank lines and text after `#` are ignored. It
//! is looked at every `backends_poll`: when its identity (device, inode), size or modification
//! time changed — a tool wrote a new file and renamed it over the old one, as Kubernetes
//! ConfigMap volumes and most tools do — it is read again. A file that is unreadable, empty,
//! or has a line that is not a backend URL or repeats one is refused whole with one log line
//! naming the file and line; the backends in force are kept.
//!
//! A removed backend's slot becomes vacant ([`Fleet::vacate`]): down for good, never chosen;
//! requests in flight to it finish on the connections they hold, and CacheRoute's plan is
//! repaired so only the keys it held move. An added backend fills a vacant slot — the one it
//! held before if free, so consistent-hashing policies and the plan give it back its keys —
//! and comes up when its first health probe passes.
//!
//! [`Fleet::vacate`]: super::fleet::Fleet::vacate

use super::config::{backend_problem, without_v1};
use super::state::{Cmd, Shared};
use crate::policy::FleetView;
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::SystemTime;

/// Parse a backends file's text: the base URLs in order, or (line number, why) for the first
/// bad line (the whole file is then refused).
pub(crate) fn parse(text: &str) -> Result<Vec<String>, (usize, String)> {
    let mut urls: Vec<String> = Vec::new();
    let mut first_line: HashMap<String, usize> = HashMap::new();
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        let b = line.split('#').next().unwrap_or("").trim();
        if b.is_empty() {
            continue;
        }
        if b.split_whitespace().nth(1).is_some() {
            return Err((
                n,
                format!("`{b}` holds more than one word; give one base URL a line"),
            ));
        }
        let b = without_v1(b).unwrap_or_else(|| b.trim_end_matches('/').to_string());
        if let Some(why) = backend_problem(&b) {
            return Err((n, why));
        }
        if let Some(before) = first_line.insert(b.clone(), n) {
            return Err((
                n,
                format!("`{b}` repeats line {before}; name each backend once"),
            ));
        }
        urls.push(b);
    }
    if urls.is_empty() {
        return Err((0, "names no backend; a router needs at least one".into()));
    }
    Ok(urls)
}

/// Read and parse the file at `path`, the message naming it and the line.
pub(crate) fn read(path: &Path) -> Result<Vec<String>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("backends file {}: {e}", path.display()))?;
    parse(&text).map_err(|(line, why)| match line {
        0 => format!("backends file {}: {why}", path.display()),
        n => format!("backends file {} line {n}: {why}", path.display()),
    })
}

/// What tells one version of the file from another.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Identity {
    dev: u64,
    ino: u64,
    len: u64,
    modified: Option<SystemTime>,
}

fn identity(path: &Path) -> Option<Identity> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).ok()?;
    Some(Identity {
        dev: m.dev(),
        ino: m.ino(),
        len: m.len(),
        modified: m.modified().ok(),
    })
}

/// Watch the backends file until the router stops (a background task).
pub(crate) fn spawn(shared: &Arc<Shared>) {
    let Some(path) = shared.cfg.backends_file.clone() else {
        return;
    };
    let s = shared.clone();
    let task = tokio::spawn(async move {
        let mut seen = identity(&path);
        let mut last_slot: HashMap<Arc<str>, usize> = s
            .fleet
            .backends()
            .into_iter()
            .map(|(d, u)| (u, d))
            .collect();
        let mut tick = tokio::time::interval(s.cfg.backends_poll);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let now = identity(&path);
            if now == seen {
                continue;
            }
            seen = now;
            // A rename may land just after a tool truncated or created the file: read what is
            // there now; a later change is seen on a later tick.
            let in_force = s.fleet.occupied();
            match read(&path) {
                Ok(urls) => {
                    if let Err(why) = apply(&s, &urls, &mut last_slot) {
                        tracing::warn!(
                            "backends file {}: {why}; the {in_force} backends in force are kept",
                            path.display()
                        );
                    }
                }
                Err(why) if seen.is_none() => tracing::warn!(
                    "{why}; the {in_force} backends in force are kept until the file is back"
                ),
                Err(why) => {
                    tracing::warn!("{why}; the {in_force} backends in force are kept")
                }
            }
        }
    });
    shared.background.lock().expect("background").push(task);
}

/// Make the fleet hold exactly `urls`: remove those gone, add the new ones to vacant slots
/// (each to the slot it last held when free). Refused, changing nothing, when they do not fit.
fn apply(
    s: &Shared,
    urls: &[String],
    last_slot: &mut HashMap<Arc<str>, usize>,
) -> Result<(), String> {
    let slots = s.fleet.len();
    if urls.len() > slots {
        return Err(format!(
            "names {} backends, more than the {slots} destination slots (--max-backends)",
            urls.len()
        ));
    }
    let current = s.fleet.backends();
    let removed: Vec<(usize, Arc<str>)> = current
        .iter()
        .filter(|(_, u)| !urls.iter().any(|x| **x == **u))
        .cloned()
        .collect();
    let added: Vec<&String> = urls
        .iter()
        .filter(|x| !current.iter().any(|(_, u)| ***x == **u))
        .collect();
    if removed.is_empty() && added.is_empty() {
        return Ok(());
    }
    for (d, u) in &removed {
        s.targets.set(*d, None);
        s.fleet.vacate(*d);
        tracing::info!(
            destination = d,
            url = %u,
            live = s.fleet.live(),
            "destination {d} removed ({u}): no longer in the backends file; requests in flight to it finish"
        );
    }
    for u in added {
        let free = |d: usize| s.fleet.is_vacant(d);
        let held_by_other = |d: usize| last_slot.iter().any(|(x, &e)| e == d && **x != **u);
        let d = last_slot
            .get(u.as_str())
            .copied()
            .filter(|&d| free(d))
            .or_else(|| (0..slots).find(|&d| free(d) && !held_by_other(d)))
            .or_else(|| (0..slots).find(|&d| free(d)))
            .expect("no more backends than slots");
        s.marks[d].reset();
        s.targets.set(d, Some(u));
        s.fleet.fill(d, u);
        last_slot.insert(u.as_str().into(), d);
        tracing::info!(
            destination = d,
            url = %u,
            "destination {d} added ({u}) from the backends file: up when its first health probe passes"
        );
    }
    if !removed.is_empty() {
        s.send_control(Cmd::Repair);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::parse;

    #[test]
    fn a_backends_file_parses_with_comments_and_names_its_bad_line() {
        let ok = "# fleet\nhttp://10.0.0.1:8000\n\n  http://10.0.0.2:8000/v1  # gpu-2\nhttp://10.0.0.3:8000/\n";
        assert_eq!(
            parse(ok).unwrap(),
            [
                "http://10.0.0.1:8000",
                "http://10.0.0.2:8000",
                "http://10.0.0.3:8000"
            ]
        );
        let (line, why) = parse("http://a:1\nhttp://b:2\nhttp://a:1/\n").unwrap_err();
        assert_eq!(line, 3);
        assert!(why.contains("repeats line 1"), "{why}");
        let (line, why) = parse("http://a:1\nnot a url\n").unwrap_err();
        assert_eq!(line, 2, "{why}");
        let (line, why) = parse("http://a:1\nhttp://b:2/v1/completions\n").unwrap_err();
        assert_eq!(line, 2);
        assert!(why.contains("endpoint"), "{why}");
        let (line, why) = parse("https://a:1\n").unwrap_err();
        assert_eq!(line, 1, "{why}");
        assert_eq!(parse("# nothing\n\n").unwrap_err().0, 0);
        assert_eq!(parse("").unwrap_err().0, 0);
    }
}

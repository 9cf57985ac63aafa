//! Progress of long work (studies, `advise`): indicatif bars on a terminal (for a study,
//! [`StudyBars`]: an overall bar and a spinner per worker); anywhere else (CI, a pipe, a log
//! file), where the bars are not drawn, one log line every `CACHEROUTE_PROGRESS_S` seconds
//! (default 10) with the steps done, the time spent and the time left. Log lines and bars do
//! not fight: the logger writes each line through [`suspend`], which clears the bars for it and
//! draws them again after.

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// The default seconds between two progress lines when stderr is not a terminal.
pub const DEFAULT_EVERY_S: f64 = 10.0;

/// The bars being drawn now, for [`suspend`].
#[derive(Clone)]
enum Drawn {
    Multi(MultiProgress),
    Bar(ProgressBar),
}

static DRAWN: Mutex<Option<Drawn>> = Mutex::new(None);

/// Run `f` (a log line being written) with the bars cleared, then draw them again.
pub fn suspend<R>(f: impl FnOnce() -> R) -> R {
    let d = DRAWN.lock().ok().and_then(|d| d.clone());
    match d {
        Some(Drawn::Multi(m)) => m.suspend(f),
        Some(Drawn::Bar(b)) => b.suspend(f),
        None => f(),
    }
}

/// While alive: the bars are known to [`suspend`] (on a terminal), or a thread logs the
/// progress of `bar` every few seconds (elsewhere). Dropping it stops either.
pub struct Shown {
    registered: bool,
    ticker: Option<(Stop, std::thread::JoinHandle<()>)>,
}

/// Set to stop the ticker thread (with its condition variable, to wake it).
type Stop = Arc<(Mutex<bool>, Condvar)>;

impl Shown {
    /// `bar` (drawn alone, or inside `multi`) counts the steps of `what`.
    pub fn new(multi: Option<&MultiProgress>, bar: &ProgressBar, what: &str) -> Shown {
        if std::io::stderr().is_terminal() {
            if let Ok(mut d) = DRAWN.lock() {
                *d = Some(match multi {
                    Some(m) => Drawn::Multi(m.clone()),
                    None => Drawn::Bar(bar.clone()),
                });
            }
            return Shown {
                registered: true,
                ticker: None,
            };
        }
        let every = std::env::var("CACHEROUTE_PROGRESS_S")
            .ok()
            .and_then(|v| v.parse::<f64>().ok())
            .and_then(|s| Duration::try_from_secs_f64(s).ok())
            .filter(|d| !d.is_zero())
            .unwrap_or(Duration::from_secs_f64(DEFAULT_EVERY_S));
        Shown::ticking(bar, what, every, |line| tracing::info!("{line}"))
    }

    /// Call `say` with a progress line of `bar` every `every` until dropped.
    fn ticking(
        bar: &ProgressBar,
        what: &str,
        every: Duration,
        say: impl Fn(String) + Send + 'static,
    ) -> Shown {
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let (bar, what, stop2) = (bar.clone(), what.to_string(), stop.clone());
        let t = std::thread::spawn(move || {
            let (lock, cv) = &*stop2;
            let mut stopped = lock.lock().expect("progress");
            loop {
                let (s, timeout) = cv.wait_timeout(stopped, every).expect("progress");
                stopped = s;
                if *stopped {
                    return;
                }
                if timeout.timed_out() {
                    say(line(&bar, &what));
                }
            }
        });
        Shown {
            registered: false,
            ticker: Some((stop, t)),
        }
    }
}

/// `what: 12/40 steps (30%), 95 s spent, about 222 s left`.
fn line(bar: &ProgressBar, what: &str) -> String {
    let (pos, len) = (bar.position(), bar.length().unwrap_or(0));
    let spent = bar.elapsed().as_secs_f64();
    let left = if pos > 0 && len >= pos {
        format!(
            ", about {:.0} s left",
            spent * (len - pos) as f64 / pos as f64
        )
    } else {
        String::new()
    };
    let pct = if len > 0 {
        format!(" ({:.0}%)", 100.0 * pos as f64 / len as f64)
    } else {
        String::new()
    };
    format!("{what}: {pos}/{len} steps{pct}, {spent:.0} s spent{left}")
}

impl Drop for Shown {
    fn drop(&mut self) {
        if self.registered {
            if let Ok(mut d) = DRAWN.lock() {
                *d = None;
            }
        }
        if let Some((stop, t)) = self.ticker.take() {
            *stop.0.lock().expect("progress") = true;
            stop.1.notify_all();
            let _ = t.join();
        }
    }
}

/// A study's progress display: an overall bar of its steps and a spinner per worker thread on a
/// terminal; elsewhere (a log file, CI) a progress line every few seconds instead ([`Shown`]).
pub struct StudyBars {
    mp: MultiProgress,
    overall: ProgressBar,
    /// Log lines kept off the bars, or a progress line every few seconds off a terminal.
    _shown: Option<Shown>,
}

impl StudyBars {
    /// The overall bar of study `name`'s `total` steps, drawn on stderr when `show`.
    pub fn new(name: &str, total: usize, show: bool) -> Self {
        let terminal = std::io::stderr().is_terminal();
        let mp = MultiProgress::with_draw_target(if show && terminal {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        });
        let overall = mp.add(ProgressBar::new(total as u64));
        overall.set_style(
            ProgressStyle::with_template(
                "{prefix} [{bar:30}] {pos}/{len} steps {elapsed_precise} eta {eta}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        overall.set_prefix(name.to_owned());
        let _shown = show.then(|| Shown::new(Some(&mp), &overall, name));
        Self {
            mp,
            overall,
            _shown,
        }
    }

    /// The bar counting the study's steps (its length grows as knee probes are added).
    pub fn overall(&self) -> &ProgressBar {
        &self.overall
    }

    /// A spinner for worker `w`.
    pub fn worker_bar(&self, w: usize) -> ProgressBar {
        let bar = self.mp.add(ProgressBar::new_spinner());
        bar.set_prefix(format!("worker {w}"));
        bar.set_style(
            ProgressStyle::with_template("  {prefix}: {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_spinner()),
        );
        bar
    }

    /// Clear the display.
    pub fn finish(self) {
        self.overall.finish_and_clear();
        let _ = self.mp.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_a_terminal_a_line_comes_every_interval_until_dropped() {
        let bar = ProgressBar::hidden();
        bar.set_length(40);
        bar.set_position(10);
        let lines = Arc::new(Mutex::new(Vec::new()));
        let l2 = lines.clone();
        let shown = Shown::ticking(&bar, "study s", Duration::from_millis(20), move |l| {
            l2.lock().unwrap().push(l)
        });
        std::thread::sleep(Duration::from_millis(300));
        drop(shown);
        let n = lines.lock().unwrap().len();
        assert!(n >= 3, "{n} lines in 300 ms at one per 20 ms");
        let first = lines.lock().unwrap()[0].clone();
        assert!(
            first.starts_with("study s: 10/40 steps (25%), ") && first.contains(" s left"),
            "{first}"
        );
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(lines.lock().unwrap().len(), n, "no line after the drop");
    }
}

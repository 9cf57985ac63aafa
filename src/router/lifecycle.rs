//! What every front (`route`'s HTTP server, the EPP) does to start and stop: read the backends
//! (a file, DNS) and validate, open the traffic capture, bind, start the background work
//! (control loop, health checks, discovery), accept connections until told to stop and wait
//! for them to close, and at the end stop the background and write the state file.

use super::config::{RouterConfig, RouterError};
use super::{control, discovery, health, kv_feed, record, state};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// The backend base URLs a backends file holds (one a line, `#` comments), or why it is
/// refused, in one line naming the file and the line.
pub fn read_backends_file(path: &std::path::Path) -> Result<Vec<String>, RouterError> {
    discovery::read(path, false)
        .map(|urls| urls.iter().map(|u| u.as_str().to_string()).collect())
        .map_err(RouterError::BackendsFile)
}

/// Read the backends file or resolve the backends' DNS name (the truth about the backends:
/// what it names now replaces `backends`), normalize and validate: what every front does with
/// its config first.
pub(super) async fn prepare(cfg: &mut RouterConfig) -> Result<(), RouterError> {
    if let Some(found) = discovery::initial(cfg).await {
        cfg.backends = found?;
    }
    cfg.normalize_backends();
    cfg.validate()
}

/// Start what runs beside every front: the control loop, health checks, discovery.
pub(super) fn background(shared: &Arc<state::Shared>) -> Result<(), RouterError> {
    control::spawn(shared)?;
    health::spawn_health_checks(shared);
    discovery::spawn(shared);
    kv_feed::spawn(shared);
    Ok(())
}

/// Stop the background work and write the state file (if configured).
pub(super) fn stop(shared: &state::Shared) {
    shared.stop_background();
    if let Some(path) = &shared.cfg.state_file {
        if let Err(e) = control::save_state(shared, path) {
            tracing::warn!("router state not saved to {}: {e}", path.display());
        }
    }
}

/// A listener on `addr` and the address it got (the real port for port 0).
pub(super) async fn bind(
    addr: SocketAddr,
) -> Result<(tokio::net::TcpListener, SocketAddr), RouterError> {
    let bound = match tokio::net::TcpListener::bind(addr).await {
        Ok(l) => l.local_addr().map(|a| (l, a)),
        Err(e) => Err(e),
    };
    bound.map_err(|source| RouterError::Bind { addr, source })
}

/// `--record`'s recorder and the self-calibration's window of recent requests (filled by the
/// same capture), for `route` and `epp` alike: the recording's path is checked, and its file
/// opened, before anything listens.
pub(super) type Capturing = (Option<Arc<record::Recorder>>, Option<record::Window>);

pub(super) fn open_capture(cfg: &RouterConfig) -> Result<Capturing, RouterError> {
    let window: Option<record::Window> = cfg
        .self_calibrates()
        .then(|| Arc::new(std::sync::Mutex::new(std::collections::VecDeque::new())));
    if cfg.record.is_none() && window.is_none() {
        return Ok((None, None));
    }
    let recorder =
        record::Recorder::open(cfg.record.as_ref(), window.clone()).map_err(RouterError::Record)?;
    Ok((Some(recorder), window))
}

/// One connection as [`accept_until`] hands it over: the stream (TCP_NODELAY set), a signal
/// that turns true when the server stops accepting, and a guard to hold while it is open.
pub(super) struct Accepted {
    pub tcp: tokio::net::TcpStream,
    pub stopping: tokio::sync::watch::Receiver<bool>,
    pub alive: tokio::sync::mpsc::Sender<()>,
}

/// Accept on `listener` until `stop`, handing each connection to `each`; then stop accepting,
/// tell the connections, and wait until every one has dropped its guard. Both fronts (the
/// HTTP router, the EPP) serve this way.
pub(super) async fn accept_until(
    listener: tokio::net::TcpListener,
    stop: impl std::future::Future<Output = ()>,
    mut each: impl FnMut(Accepted),
) {
    let (stopping, stop_rx) = tokio::sync::watch::channel(false);
    // Every connection holds a sender; `recv` ends when the last one is gone.
    let (alive, mut all_gone) = tokio::sync::mpsc::channel::<()>(1);
    let mut stop = std::pin::pin!(stop);
    loop {
        let tcp = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((tcp, _)) => tcp,
                Err(_) => {
                    // Out of file descriptors or a connection reset before accept: back off
                    // briefly rather than spin.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut stop => break,
        };
        let _ = tcp.set_nodelay(true);
        each(Accepted {
            tcp,
            stopping: stop_rx.clone(),
            alive: alive.clone(),
        });
    }
    drop(listener);
    let _ = stopping.send(true);
    drop(alive);
    let _ = all_gone.recv().await;
}

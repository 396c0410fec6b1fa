//! A TCP fault proxy on a reserved loopback port: put it between a client and a server (or between two
//! servers) and switch its [`Mode`] at any time. A mode applies at once to the connections already open
//! *and* to new ones.
//!
//! | Mode | What the peers see |
//! |---|---|
//! | [`pass`](Proxy::pass) | bytes forwarded as they come |
//! | [`delay`](Proxy::delay) | every chunk held for the delay, in both directions, order kept |
//! | [`blackhole`](Proxy::blackhole) | sockets stay open, bytes are read and **dropped** (not queued): silence, never an error; new connections are accepted and silent too |
//! | [`refuse`](Proxy::refuse) | the listener is **closed**, so a new connect fails with `ECONNREFUSED`; open connections are reset |
//!
//! [`reset`](Proxy::reset) is an action, not a mode: it closes every open connection with RST (`SO_LINGER`
//! 0) on both sides and keeps accepting in the current mode.
//!
//! Blackholed bytes are gone: a client that sent a command during the blackhole gets no reply to it when
//! the proxy passes again (a kernel partition would retransmit instead; use [`crate::netcut`] for that).
//! An EOF that arrives during a blackhole is held back until the blackhole ends.
//!
//! The proxy runs on its own thread with its own current-thread tokio runtime, so it works the same from
//! sync tests and from any async runtime. The control methods block the calling thread until the
//! proxy has applied the change (microseconds to a few milliseconds), so when `refuse()` or `reset()`
//! returns, the effect is in place.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc as std_mpsc, Arc, RwLock};
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::error::{Error, Result};
use crate::ports::{self, PortLease};

/// How long a control call waits for the proxy thread to apply it.
const CONTROL_TIMEOUT: Duration = Duration::from_secs(10);
/// Read buffer per direction.
const CHUNK: usize = 16 * 1024;

/// What the proxy does with traffic; see the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Forward bytes as they come.
    Pass,
    /// Hold every chunk for this long, in both directions, order kept.
    Delay(Duration),
    /// Read and drop every byte; sockets stay open.
    Blackhole,
    /// The listener is closed (connects fail with `ECONNREFUSED`); open connections were reset.
    Refuse,
}

enum Control {
    SetMode(Mode, std_mpsc::Sender<Result<()>>),
    Reset(std_mpsc::Sender<Result<()>>),
    Shutdown,
}

/// A TCP fault proxy in front of `upstream`. Dropping it closes the listener and every connection.
pub struct Proxy {
    addr: SocketAddr,
    upstream: SocketAddr,
    control: mpsc::UnboundedSender<Control>,
    mode: watch::Receiver<Mode>,
    live: Arc<AtomicUsize>,
    /// Bytes read from clients so far, in any mode.
    sent: Arc<AtomicU64>,
    /// Replacements applied to what the upstream sends back.
    rewrites: Rewrites,
    thread: Option<JoinHandle<()>>,
    _lease: PortLease,
}

impl fmt::Debug for Proxy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Proxy")
            .field("addr", &self.addr)
            .field("upstream", &self.upstream)
            .field("mode", &*self.mode.borrow())
            .field("connections", &self.connections())
            .field("client_bytes", &self.client_bytes())
            .finish_non_exhaustive()
    }
}

impl Proxy {
    /// Starts a proxy on a reserved `127.0.0.1` port forwarding to `upstream`, in [`Mode::Pass`].
    pub fn start(upstream: SocketAddr) -> Result<Proxy> {
        let rewrites = Arc::new(RwLock::new(Vec::new()));
        let lease = ports::reserve()?;
        let addr = lease.addr();
        let (control_tx, control_rx) = mpsc::unbounded_channel();
        let (mode_tx, mode_rx) = watch::channel(Mode::Pass);
        let live = Arc::new(AtomicUsize::new(0));
        let sent = Arc::new(AtomicU64::new(0));
        let (ready_tx, ready_rx) = std_mpsc::channel::<Result<()>>();
        let (live2, sent2) = (Arc::clone(&live), Arc::clone(&sent));
        let rewrites2 = Arc::clone(&rewrites);
        let thread = std::thread::Builder::new()
            .name(format!("distlock-proxy-{}", addr.port()))
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready_tx.send(Err(Error::io("building the proxy runtime", e)));
                        return;
                    }
                };
                let counters = Counters {
                    live: live2,
                    sent: sent2,
                };
                rt.block_on(run(
                    addr, upstream, rewrites2, control_rx, mode_tx, counters, ready_tx,
                ));
                // Dropping the runtime here drops every connection task, closing its sockets.
            })
            .map_err(|e| Error::io("spawning the proxy thread", e))?;
        let proxy = Proxy {
            addr,
            upstream,
            control: control_tx,
            mode: mode_rx,
            live,
            sent,
            rewrites,
            thread: Some(thread),
            _lease: lease,
        };
        match ready_rx.recv_timeout(CONTROL_TIMEOUT) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e),
            Err(_) => {
                return Err(Error::Timeout {
                    what: format!("starting the proxy on {addr}"),
                    after: CONTROL_TIMEOUT,
                })
            }
        }
        tracing::debug!(%addr, %upstream, "proxy started");
        Ok(proxy)
    }

    /// [`start`](Self::start), panicking on failure. For tests.
    pub fn start_or_panic(upstream: SocketAddr) -> Proxy {
        match Self::start(upstream) {
            Ok(p) => p,
            Err(e) => panic!("starting a proxy to {upstream} failed: {e}"),
        }
    }

    /// Where clients connect: `127.0.0.1:<port>`.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The listening port.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// Where connections are forwarded.
    pub fn upstream(&self) -> SocketAddr {
        self.upstream
    }

    /// The current mode.
    pub fn mode(&self) -> Mode {
        *self.mode.borrow()
    }

    /// Open client connections right now.
    pub fn connections(&self) -> usize {
        self.live.load(Ordering::SeqCst)
    }

    /// Bytes read from clients so far (whatever the mode did with them). A request a client sends
    /// while the proxy holds or drops its bytes shows here as soon as the proxy has read it: "it is on
    /// its way", observable without looking inside the protocol.
    pub fn client_bytes(&self) -> u64 {
        self.sent.load(Ordering::SeqCst)
    }

    /// From now on, replaces in what the upstream sends back each `from` byte string by its `to`
    /// (within one read chunk), on open connections and new ones. For topologies that hand out server
    /// addresses (Sentinel's `SENTINEL MASTERS`, Cluster's `CLUSTER SLOTS` and redirections): rewriting a
    /// server's port to the port of one client's proxy in front of that server keeps that client on
    /// proxies of its own.
    pub fn set_rewrites(&self, rewrites: Vec<(Vec<u8>, Vec<u8>)>) {
        *self.rewrites.write().unwrap_or_else(|e| e.into_inner()) = rewrites;
    }

    /// Forward bytes as they come (re-opens the listener after [`refuse`](Self::refuse)).
    pub fn pass(&self) -> Result<()> {
        self.set_mode(Mode::Pass)
    }

    /// Hold every chunk for `delay` in both directions (a request/reply round trip gets `2 × delay`).
    pub fn delay(&self, delay: Duration) -> Result<()> {
        self.set_mode(Mode::Delay(delay))
    }

    /// Read and drop every byte, keep every socket open.
    pub fn blackhole(&self) -> Result<()> {
        self.set_mode(Mode::Blackhole)
    }

    /// Close the listener (new connects get `ECONNREFUSED`) and reset every open connection.
    pub fn refuse(&self) -> Result<()> {
        self.set_mode(Mode::Refuse)
    }

    /// Close every open connection with RST on both sides; keep accepting in the current mode.
    pub fn reset(&self) -> Result<()> {
        self.call("reset", Control::Reset)
    }

    /// Switches to `mode`; returns once it applies.
    pub fn set_mode(&self, mode: Mode) -> Result<()> {
        self.call(&format!("switching to {mode:?}"), |tx| {
            Control::SetMode(mode, tx)
        })
    }

    fn call(
        &self,
        what: &str,
        make: impl FnOnce(std_mpsc::Sender<Result<()>>) -> Control,
    ) -> Result<()> {
        let (tx, rx) = std_mpsc::channel();
        let gone = || Error::State(format!("proxy {} has stopped ({what})", self.addr));
        self.control.send(make(tx)).map_err(|_| gone())?;
        match rx.recv_timeout(CONTROL_TIMEOUT) {
            Ok(r) => r,
            Err(std_mpsc::RecvTimeoutError::Timeout) => Err(Error::Timeout {
                what: format!("proxy {}: {what}", self.addr),
                after: CONTROL_TIMEOUT,
            }),
            Err(std_mpsc::RecvTimeoutError::Disconnected) => Err(gone()),
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.control.send(Control::Shutdown);
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                eprintln!("distlock-testkit: proxy thread {} panicked", self.addr);
            }
        }
    }
}

async fn bind(addr: SocketAddr) -> Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| Error::io(format!("proxy listening on {addr}"), e))
}

/// What the proxy counts, shared with its handle.
struct Counters {
    live: Arc<AtomicUsize>,
    sent: Arc<AtomicU64>,
}

/// The proxy's main task: accepts, applies control messages, owns the connection tasks.
async fn run(
    addr: SocketAddr,
    upstream: SocketAddr,
    rewrites: Rewrites,
    mut control: mpsc::UnboundedReceiver<Control>,
    mode: watch::Sender<Mode>,
    counters: Counters,
    ready: std_mpsc::Sender<Result<()>>,
) {
    let Counters { live, sent } = counters;
    let mut listener = match bind(addr).await {
        Ok(l) => Some(l),
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let _ = ready.send(Ok(()));
    let (reset_tx, _) = watch::channel(0u64);
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            accepted = async {
                match &listener {
                    Some(l) => l.accept().await,
                    None => std::future::pending().await,
                }
            } => match accepted {
                Ok((client, peer)) => {
                    let conn = Conn {
                        upstream,
                        rewrites: Arc::clone(&rewrites),
                        mode: mode.subscribe(),
                        reset: reset_tx.subscribe(),
                        live: Arc::clone(&live),
                        sent: Arc::clone(&sent),
                    };
                    tracing::trace!(%addr, %peer, "proxy accepted");
                    conns.spawn(conn.run(client));
                }
                Err(e) => {
                    tracing::warn!(%addr, error = %e, "proxy accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            msg = control.recv() => match msg {
                None | Some(Control::Shutdown) => break,
                Some(Control::Reset(reply)) => {
                    reset_all(&reset_tx, &mut conns).await;
                    let _ = reply.send(Ok(()));
                }
                Some(Control::SetMode(new, reply)) => {
                    let result = if new == Mode::Refuse {
                        listener = None;
                        mode.send_replace(new);
                        reset_all(&reset_tx, &mut conns).await;
                        Ok(())
                    } else {
                        let r = if listener.is_none() {
                            bind(addr).await.map(|l| listener = Some(l))
                        } else {
                            Ok(())
                        };
                        if r.is_ok() {
                            mode.send_replace(new);
                        }
                        r
                    };
                    tracing::debug!(%addr, mode = ?new, "proxy mode");
                    let _ = reply.send(result);
                }
            },
        }
    }
    conns.abort_all();
    while conns.join_next().await.is_some() {}
}

/// Tells every connection to reset and waits until all have closed their sockets.
async fn reset_all(reset: &watch::Sender<u64>, conns: &mut JoinSet<()>) {
    reset.send_modify(|g| *g += 1);
    while conns.join_next().await.is_some() {}
}

/// Byte strings replaced, `(from, to)`, in what the upstream sends back.
type RewriteRules = RwLock<Vec<(Vec<u8>, Vec<u8>)>>;
/// A proxy's replacements, shared by its handle and its connections.
type Rewrites = Arc<RewriteRules>;

struct Conn {
    upstream: SocketAddr,
    rewrites: Rewrites,
    mode: watch::Receiver<Mode>,
    reset: watch::Receiver<u64>,
    live: Arc<AtomicUsize>,
    sent: Arc<AtomicU64>,
}

/// One queued item of a direction.
enum Item {
    Data(Instant, Vec<u8>),
    Eof,
}

impl Conn {
    async fn run(self, mut client: TcpStream) {
        self.live.fetch_add(1, Ordering::SeqCst);
        let mut reset = self.reset.clone();
        reset.mark_unchanged();
        let upstream = tokio::select! {
            r = TcpStream::connect(self.upstream) => r,
            _ = reset.changed() => {
                abort(&client);
                self.live.fetch_sub(1, Ordering::SeqCst);
                return;
            }
        };
        let mut upstream = match upstream {
            Ok(u) => u,
            Err(e) => {
                // The upstream is down: the client sees a reset, as if the server were unreachable.
                tracing::debug!(upstream = %self.upstream, error = %e, "proxy upstream connect failed");
                abort(&client);
                self.live.fetch_sub(1, Ordering::SeqCst);
                return;
            }
        };
        let _ = client.set_nodelay(true);
        let _ = upstream.set_nodelay(true);
        let outcome = {
            let (cr, cw) = client.split();
            let (ur, uw) = upstream.split();
            let up = pump(cr, uw, self.mode.clone(), Some(&self.sent), None);
            let down = pump(ur, cw, self.mode.clone(), None, Some(&self.rewrites));
            tokio::select! {
                r = async { tokio::try_join!(up, down) } => r.map(|_| ()),
                _ = reset.changed() => Err(io::Error::other("reset")),
            }
        };
        if outcome.is_err() {
            abort(&client);
            abort(&upstream);
        }
        self.live.fetch_sub(1, Ordering::SeqCst);
    }
}

/// `chunk` with every `from` of `rewrites` replaced by its `to`, left to right, without overlaps.
fn rewrite(chunk: &[u8], rewrites: &[(Vec<u8>, Vec<u8>)]) -> Vec<u8> {
    if rewrites.is_empty() {
        return chunk.to_vec();
    }
    let mut out = Vec::with_capacity(chunk.len());
    let mut i = 0;
    'bytes: while i < chunk.len() {
        for (from, to) in rewrites {
            if !from.is_empty() && chunk[i..].starts_with(from) {
                out.extend_from_slice(to);
                i += from.len();
                continue 'bytes;
            }
        }
        out.push(chunk[i]);
        i += 1;
    }
    out
}

/// RST on close: `SO_LINGER` 0.
fn abort(s: &TcpStream) {
    let _ = s.set_zero_linger();
}

/// Copies one direction under the current mode; `Err` means the connection must be reset.
async fn pump(
    mut from: tokio::net::tcp::ReadHalf<'_>,
    mut to: tokio::net::tcp::WriteHalf<'_>,
    mode: watch::Receiver<Mode>,
    counted: Option<&AtomicU64>,
    rewrites: Option<&RewriteRules>,
) -> io::Result<()> {
    let (tx, mut rx) = mpsc::unbounded_channel::<Item>();
    let read_mode = mode.clone();
    let reader = async move {
        let mut buf = vec![0u8; CHUNK];
        loop {
            let n = from.read(&mut buf).await?;
            if n == 0 {
                let _ = tx.send(Item::Eof);
                return Ok::<(), io::Error>(());
            }
            if let Some(counted) = counted {
                counted.fetch_add(n as u64, Ordering::SeqCst);
            }
            let m = *read_mode.borrow();
            let due = match m {
                Mode::Blackhole | Mode::Refuse => continue,
                Mode::Pass => Instant::now(),
                Mode::Delay(d) => Instant::now() + d,
            };
            let bytes = match rewrites {
                Some(r) => rewrite(&buf[..n], &r.read().unwrap_or_else(|e| e.into_inner())),
                None => buf[..n].to_vec(),
            };
            let _ = tx.send(Item::Data(due, bytes));
        }
    };
    let mut write_mode = mode;
    let writer = async move {
        while let Some(item) = rx.recv().await {
            match item {
                Item::Data(due, bytes) => {
                    tokio::time::sleep_until(due).await;
                    if matches!(*write_mode.borrow(), Mode::Blackhole | Mode::Refuse) {
                        continue;
                    }
                    to.write_all(&bytes).await?;
                }
                Item::Eof => {
                    // A partition swallows the FIN too: hold it until the blackhole ends.
                    let _ = write_mode
                        .wait_for(|m| !matches!(m, Mode::Blackhole | Mode::Refuse))
                        .await;
                    to.shutdown().await?;
                    return Ok(());
                }
            }
        }
        Ok::<(), io::Error>(())
    };
    tokio::try_join!(reader, writer).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::rewrite;

    #[test]
    fn rewrite_replaces_every_match_left_to_right() {
        let rules = vec![
            (b":21006\r\n".to_vec(), b":25001\r\n".to_vec()),
            (b"$5\r\n21007\r\n".to_vec(), b"$4\r\n2500\r\n".to_vec()),
        ];
        assert_eq!(
            rewrite(
                b"-MOVED 1 127.0.0.1:21006\r\n$5\r\n21007\r\n:210060\r\n",
                &rules
            ),
            b"-MOVED 1 127.0.0.1:25001\r\n$4\r\n2500\r\n:210060\r\n".to_vec()
        );
        assert_eq!(rewrite(b"abc", &[]), b"abc".to_vec());
    }
}

//! Free loopback TCP ports that stay reserved across parallel test *processes*.
//!
//! `cargo nextest` runs every test in its own process, so an in-process counter cannot keep two servers
//! off one port, and "bind port 0, read it, close it, hand it to the server" races with every other test
//! doing the same. Instead each candidate port in a fixed range gets an `flock` on
//! `$TMPDIR/distlock-testkit/ports/<port>.lock`; the lock lives in the [`PortLease`], which the server's
//! handle keeps until the server is gone (also across kill -9 and restart). The kernel drops the lock
//! when the holder dies, however it dies. A quick `bind(127.0.0.1:port)` then rules out ports some other
//! program listens on.
//!
//! The range 20000-29999 sits below Linux's default ephemeral range (32768-60999), so outgoing client
//! connections never occupy a candidate. Ports that also need `port + 10000` free (the Redis Cluster bus)
//! come from 20000-22767, which puts the bus at 30000-32767: still below the ephemeral range and far
//! below 65535.

use std::collections::hash_map::RandomState;
use std::fs::{File, OpenOptions};
use std::hash::BuildHasher as _;
use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener};

use rustix::fs::{flock, FlockOperation};

use crate::error::{Error, Result};
use crate::sweep::state_dir;

/// First port handed out.
pub const FIRST_PORT: u16 = 20000;
/// Last port handed out by [`reserve`].
pub const LAST_PORT: u16 = 29999;
/// Offset of the Redis Cluster bus port.
pub const BUS_OFFSET: u16 = 10000;
/// Last port handed out by [`reserve_with_bus`]; its bus port is 32767, just below the ephemeral range.
pub const LAST_BUS_PORT: u16 = 22767;

/// A reserved loopback port (and, from [`reserve_with_bus`], its `+10000` bus port).
///
/// Keep it for as long as a server may listen on the port: dropping it lets another test take the port.
#[derive(Debug)]
pub struct PortLease {
    port: u16,
    bus: Option<u16>,
    /// Holds the `flock`; closing the file releases it.
    _lock: File,
}

impl PortLease {
    /// The reserved port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The bus port (`port + 10000`), if this lease came from [`reserve_with_bus`].
    pub fn bus_port(&self) -> Option<u16> {
        self.bus
    }

    /// `127.0.0.1:port`.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, self.port))
    }
}

/// Reserves one free loopback port from 20000-29999.
pub fn reserve() -> Result<PortLease> {
    reserve_in(FIRST_PORT, LAST_PORT, false)
}

/// Reserves a port from 20000-22767 whose `port + 10000` is free too (Redis Cluster's bus).
pub fn reserve_with_bus() -> Result<PortLease> {
    reserve_in(FIRST_PORT, LAST_BUS_PORT, true)
}

/// Reserves `n` distinct ports (etcd needs 2 per member, a ZooKeeper ensemble member 3).
pub fn reserve_many(n: usize) -> Result<Vec<PortLease>> {
    (0..n).map(|_| reserve()).collect()
}

fn reserve_in(first: u16, last: u16, with_bus: bool) -> Result<PortLease> {
    let dir = state_dir("ports")?;
    let span = u32::from(last - first) + 1;
    // A random start spreads parallel tests over the range, so they rarely contend for the same lock.
    let start = (RandomState::new().hash_one(std::process::id()) % u64::from(span)) as u32;
    for i in 0..span {
        let Ok(port) = u16::try_from(u32::from(first) + (start + i) % span) else {
            continue;
        };
        let path = dir.join(format!("{port}.lock"));
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| Error::io(format!("opening {}", path.display()), e))?;
        match flock(&file, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => {}
            Err(rustix::io::Errno::WOULDBLOCK) => continue,
            Err(e) => {
                return Err(Error::io(
                    format!("locking {}", path.display()),
                    io::Error::from(e),
                ))
            }
        }
        if !bindable(port) {
            continue; // the lock is released with `file`
        }
        let bus = if with_bus {
            let bus = port + BUS_OFFSET;
            if !bindable(bus) {
                continue;
            }
            Some(bus)
        } else {
            None
        };
        tracing::debug!(port, ?bus, "reserved port");
        return Ok(PortLease {
            port,
            bus,
            _lock: file,
        });
    }
    Err(Error::NoFreePort { first, last })
}

/// Whether nothing listens on `127.0.0.1:port` right now. std sets `SO_REUSEADDR`, as servers do, so
/// leftover TIME_WAIT connections of an earlier server do not make a port look busy.
fn bindable(port: u16) -> bool {
    TcpListener::bind((Ipv4Addr::LOCALHOST, port)).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_are_exclusive_within_a_process() {
        let a = reserve().expect("reserve a");
        let b = reserve().expect("reserve b");
        assert_ne!(a.port(), b.port());
        assert!((FIRST_PORT..=LAST_PORT).contains(&a.port()));
    }

    #[test]
    fn bus_ports_stay_in_range() {
        let l = reserve_with_bus().expect("reserve with bus");
        assert!(l.port() <= LAST_BUS_PORT);
        assert_eq!(l.bus_port(), Some(l.port() + BUS_OFFSET));
    }
}

//! Real-server test kit for distlock.
//!
//! * [`process`], [`ports`], [`sweep`]: spawn real server processes on reserved loopback ports, identify
//!   them by pid, kill their process group on drop, and sweep what a SIGKILLed test left behind.
//! * [`redis`]: a standalone `redis-server` (the first server kind; etcd, ZooKeeper, PostgreSQL and
//!   MariaDB slot in the same way).
//! * [`sentinel`], [`cluster`]: Redis master + replica + 3 Sentinels, and a 6-node Redis Cluster, with
//!   failover waits; [`proxy`] (a TCP fault proxy: pass, delay, blackhole, reset, refuse) and
//!   [`netcut`] (nftables drops on loopback, root only) inject network faults; [`tls`] makes a test CA
//!   and server certificate at test time.
//! * [`postgres`]: a PostgreSQL 15 server (initdb in a temp dir, run as a non-root user, loopback port
//!   and unix socket in the temp dir).
//! * [`conformance`]: the behaviours every backend must show, as `pub async fn`s, expanded per backend by
//!   [`conformance_suite!`].

pub mod error;
pub mod holder;
pub mod ports;
pub mod process;
pub mod redis;
pub mod redlock;
pub mod sweep;

pub mod cluster;
pub mod etcd;
pub mod mariadb;
pub mod netcut;
pub mod pgbouncer;
pub mod postgres;
pub mod proxy;
pub mod sentinel;
pub mod tls;
pub mod zookeeper;

pub mod cli_run;
pub mod conformance;
pub mod conformance_kinds;
pub mod wake;

pub use error::{Error, Result};

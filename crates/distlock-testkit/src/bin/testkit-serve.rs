//! Starts one engine's server the way a test does (a free loopback port, a temporary directory) and
//! keeps it until its stdin closes: what `scripts/performance.sh` benchmarks against.
//!
//! Usage: `testkit-serve ENGINE` with ENGINE one of redis, redlock, etcd, zk, postgres, mysql. Prints
//! the server's distlock URL as one line on stdout, then waits; the server stops when stdin reaches
//! its end (or when this process dies: the test kit's servers die with the process that started them).

use std::io::{BufRead, Write};

use distlock_testkit::etcd::EtcdServer;
use distlock_testkit::mariadb::MariaDbServer;
use distlock_testkit::postgres::PostgresServer;
use distlock_testkit::redis::RedisServer;
use distlock_testkit::redlock::RedlockNodes;
use distlock_testkit::zookeeper::ZkServer;

const ENGINES: &str = "redis, redlock, etcd, zk, postgres, mysql";

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let engine = std::env::args()
        .nth(1)
        .ok_or(format!("usage: testkit-serve ENGINE ({ENGINES})"))?;
    // Each server stops when its value is dropped, at the end of `main`.
    let (url, _server): (String, Box<dyn std::any::Any>) = match engine.as_str() {
        "redis" => {
            let s = RedisServer::start()?;
            (s.url(), Box::new(s))
        }
        "redlock" => {
            let s = RedlockNodes::start(5)?;
            (s.url(), Box::new(s))
        }
        "etcd" => {
            let s = EtcdServer::start()?;
            (s.url(), Box::new(s))
        }
        "zk" => {
            let s = ZkServer::start()?;
            (s.url(), Box::new(s))
        }
        "postgres" => {
            let s = PostgresServer::start()?;
            (s.url(), Box::new(s))
        }
        "mysql" => {
            let s = MariaDbServer::start()?;
            (s.url(), Box::new(s))
        }
        other => return Err(format!("unknown engine {other:?}; known: {ENGINES}").into()),
    };
    let mut out = std::io::stdout().lock();
    writeln!(out, "{url}")?;
    out.flush()?;
    // Until stdin ends.
    for line in std::io::stdin().lock().lines() {
        line?;
    }
    Ok(())
}

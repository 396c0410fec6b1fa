//! Self-tests of the TCP fault proxy and the nftables loopback cut against a real `redis-server`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use distlock_testkit::netcut::LoopbackCut;
use distlock_testkit::proxy::{Mode, Proxy};
use distlock_testkit::redis::{RedisServer, RespConn, RespValue};
use distlock_testkit::Error;

const SHORT: Duration = Duration::from_millis(300);
const LONG: Duration = Duration::from_secs(5);

fn pong() -> RespValue {
    RespValue::Simple("PONG".into())
}

fn ping(conn: &mut RespConn) -> distlock_testkit::Result<RespValue> {
    conn.command(&["PING"])
}

/// A transport failure that is not a timeout: the peer reset or closed the connection.
fn assert_reset_or_eof(err: &Error) {
    assert!(
        matches!(err, Error::Io { .. } | Error::Protocol(_)),
        "expected a reset or EOF, got {err}"
    );
}

#[test]
fn proxy_forwards_to_the_server() {
    let redis = RedisServer::start_or_panic();
    let proxy = Proxy::start_or_panic(redis.addr());
    assert_eq!(proxy.upstream(), redis.addr());
    assert_eq!(proxy.addr().ip().to_string(), "127.0.0.1");
    assert_ne!(proxy.port(), redis.port());
    assert_eq!(proxy.mode(), Mode::Pass);
    let mut conn = RespConn::connect(proxy.addr(), LONG).unwrap();
    assert_eq!(ping(&mut conn).unwrap(), pong());
    // A larger payload both ways, to cross chunk boundaries.
    let big = "x".repeat(200_000);
    conn.command(&["SET", "k", &big]).unwrap();
    assert_eq!(
        conn.command(&["GET", "k"]).unwrap(),
        RespValue::Bulk(big.into_bytes())
    );
    assert_eq!(proxy.connections(), 1);
}

#[test]
fn proxy_delay_applies_to_open_and_new_connections() {
    let redis = RedisServer::start_or_panic();
    let proxy = Proxy::start_or_panic(redis.addr());
    let mut open = RespConn::connect(proxy.addr(), LONG).unwrap();
    assert_eq!(ping(&mut open).unwrap(), pong());

    let delay = Duration::from_millis(150);
    proxy.delay(delay).unwrap();
    assert_eq!(proxy.mode(), Mode::Delay(delay));
    let t = Instant::now();
    assert_eq!(ping(&mut open).unwrap(), pong());
    // Request and reply are both held: the round trip takes at least twice the delay.
    assert!(t.elapsed() >= 2 * delay, "round trip {:?}", t.elapsed());

    let mut fresh = RespConn::connect(proxy.addr(), LONG).unwrap();
    let t = Instant::now();
    assert_eq!(ping(&mut fresh).unwrap(), pong());
    assert!(t.elapsed() >= 2 * delay, "round trip {:?}", t.elapsed());

    // Pipelined commands keep their order under delay.
    for i in 0..5 {
        fresh.command(&["RPUSH", "l", &i.to_string()]).unwrap();
    }
    proxy.pass().unwrap();
    let list = fresh.command(&["LRANGE", "l", "0", "-1"]).unwrap();
    let want: Vec<RespValue> = (0..5)
        .map(|i| RespValue::Bulk(i.to_string().into_bytes()))
        .collect();
    assert_eq!(list, RespValue::Array(want));
}

#[test]
fn proxy_blackhole_is_silence_and_pass_restores_the_same_connection() {
    let redis = RedisServer::start_or_panic();
    let proxy = Proxy::start_or_panic(redis.addr());
    let mut conn = RespConn::connect(proxy.addr(), SHORT).unwrap();
    assert_eq!(ping(&mut conn).unwrap(), pong());

    proxy.blackhole().unwrap();
    let err = ping(&mut conn).expect_err("a blackholed PING must not be answered");
    assert!(err.is_timeout(), "expected a timeout, got {err}");
    // New connections are accepted (connect succeeds) but silent too.
    let mut fresh = RespConn::connect(proxy.addr(), SHORT).unwrap();
    assert!(ping(&mut fresh).unwrap_err().is_timeout());
    assert_eq!(proxy.connections(), 2);

    proxy.pass().unwrap();
    // The socket stayed open: the same connection works again (the blackholed PING was dropped, so
    // no stale reply is in the way).
    conn.set_timeout(LONG).unwrap();
    assert_eq!(ping(&mut conn).unwrap(), pong());
}

#[test]
fn proxy_reset_closes_open_connections_and_keeps_accepting() {
    let redis = RedisServer::start_or_panic();
    let proxy = Proxy::start_or_panic(redis.addr());
    let mut conn = RespConn::connect(proxy.addr(), LONG).unwrap();
    assert_eq!(ping(&mut conn).unwrap(), pong());
    let clients_before = redis.command(&["CLIENT", "LIST"]).unwrap();

    proxy.reset().unwrap();
    assert_eq!(proxy.connections(), 0);
    let err = ping(&mut conn).expect_err("a reset connection must fail");
    assert_reset_or_eof(&err);

    // The server side was closed too.
    let count = |v: &RespValue| v.as_str().unwrap().lines().count();
    let deadline = Instant::now() + LONG;
    loop {
        let clients_after = redis.command(&["CLIENT", "LIST"]).unwrap();
        if count(&clients_after) == count(&clients_before) - 1 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "server kept the connection: {clients_after}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }

    let mut fresh = RespConn::connect(proxy.addr(), LONG).unwrap();
    assert_eq!(ping(&mut fresh).unwrap(), pong());
}

#[test]
fn proxy_refuse_fails_new_connects_and_resets_open_ones() {
    let redis = RedisServer::start_or_panic();
    let proxy = Proxy::start_or_panic(redis.addr());
    let mut conn = RespConn::connect(proxy.addr(), LONG).unwrap();
    assert_eq!(ping(&mut conn).unwrap(), pong());

    proxy.refuse().unwrap();
    assert_eq!(proxy.mode(), Mode::Refuse);
    assert_reset_or_eof(&ping(&mut conn).unwrap_err());
    let err = RespConn::connect(proxy.addr(), LONG).expect_err("connect must be refused");
    assert!(
        err.to_string().to_lowercase().contains("refused"),
        "expected connection refused, got {err}"
    );

    proxy.pass().unwrap();
    let mut fresh = RespConn::connect(proxy.addr(), LONG).unwrap();
    assert_eq!(ping(&mut fresh).unwrap(), pong());
}

#[test]
fn proxy_to_a_dead_upstream_resets_the_client() {
    let mut redis = RedisServer::start_or_panic();
    let proxy = Proxy::start_or_panic(redis.addr());
    redis.kill9().unwrap();
    match RespConn::connect(proxy.addr(), LONG) {
        Ok(mut conn) => assert_reset_or_eof(&ping(&mut conn).unwrap_err()),
        // The same reset, seen by the connect: the proxy accepts, finds the upstream dead and
        // resets the client, which on a loaded machine can all happen before the client's
        // connect (a non-blocking connect and a poll) has looked at its socket. A refused connect
        // (a closed listener) is not that.
        Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::ConnectionReset => {}
        Err(e) => panic!("expected the connect to succeed or be reset, got {e}"),
    }
    redis.restart().unwrap();
    let mut conn = RespConn::connect(proxy.addr(), LONG).unwrap();
    assert_eq!(ping(&mut conn).unwrap(), pong());
}

#[test]
fn dropping_the_proxy_closes_the_listener_and_connections() {
    let redis = RedisServer::start_or_panic();
    let proxy = Proxy::start_or_panic(redis.addr());
    let addr = proxy.addr();
    let mut conn = RespConn::connect(addr, LONG).unwrap();
    assert_eq!(ping(&mut conn).unwrap(), pong());
    drop(proxy);
    assert!(
        RespConn::connect(addr, LONG).is_err(),
        "listener survived drop"
    );
    assert!(ping(&mut conn).is_err(), "connection survived drop");
}

#[tokio::test]
async fn proxy_works_inside_an_async_runtime() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    let redis = RedisServer::start_or_panic();
    let proxy = Proxy::start_or_panic(redis.addr());
    let mut stream = tokio::net::TcpStream::connect(proxy.addr()).await.unwrap();
    stream.write_all(b"*1\r\n$4\r\nPING\r\n").await.unwrap();
    let mut buf = [0u8; 7];
    tokio::time::timeout(LONG, stream.read_exact(&mut buf))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&buf, b"+PONG\r\n");
    proxy.blackhole().unwrap();
    stream.write_all(b"*1\r\n$4\r\nPING\r\n").await.unwrap();
    let silent = tokio::time::timeout(SHORT, stream.read(&mut buf)).await;
    assert!(silent.is_err(), "blackholed PING answered: {silent:?}");
    // Dropping inside the runtime must not panic.
    drop(proxy);
}

#[test]
fn netcut_fault_cut_port_silences_the_server_and_heal_restores_it() {
    let redis = RedisServer::start_or_panic();
    let mut conn = redis.connect(LONG).unwrap();
    assert_eq!(ping(&mut conn).unwrap(), pong());

    let mut cut = LoopbackCut::new_or_panic();
    assert!(cut.table().starts_with("distlock_"));
    cut.cut_port(redis.port()).unwrap();
    assert_eq!(cut.cut_ports(), &[redis.port()]);
    conn.set_timeout(SHORT).unwrap();
    let err = ping(&mut conn).expect_err("a cut server must not answer");
    assert!(err.is_timeout(), "expected a timeout, got {err}");
    // A new connect hangs (SYNs are dropped), it is not refused.
    let err = RespConn::connect(redis.addr(), SHORT).expect_err("connect through a cut");
    assert!(err.is_timeout(), "expected a connect timeout, got {err}");

    cut.heal().unwrap();
    assert!(cut.cut_ports().is_empty());
    let mut fresh = redis.connect(LONG).unwrap();
    assert_eq!(ping(&mut fresh).unwrap(), pong());
    // The old connection recovers once TCP retransmits the queued PING.
    conn.set_timeout(LONG).unwrap();
    assert_eq!(ping(&mut conn).unwrap(), pong());

    let table = cut.table().to_owned();
    drop(cut);
    let out = std::process::Command::new("nft")
        .args(["list", "tables"])
        .output()
        .unwrap();
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains(&table),
        "table {table} left behind"
    );
}

#[test]
fn netcut_rejects_non_loopback_addresses() {
    let mut cut = LoopbackCut::new_or_panic();
    assert!(cut.cut_addr("10.0.0.1".parse().unwrap()).is_err());
    cut.cut_addr("127.0.0.9".parse().unwrap()).unwrap();
    assert_eq!(cut.cut_addrs().len(), 1);
    cut.heal().unwrap();
}

//! Interop with real Apache Curator (Debian's libcurator-*-java 5.x): a Java program using
//! `InterProcessMutex`, compiled at test time with javac (tests/java/CuratorLock.java), and distlock
//! exclude each other on the same path and share one queue in creation order.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::{children, name, raw_client, wait_children, Curator};
use distlock_core::url::LockUrl;
use distlock_core::Locks;
use distlock_testkit::cli_run::no_wait_run;
use distlock_testkit::zookeeper::ZkServer;
use distlock_zookeeper::ZkBackend;

async fn locks(server: &ZkServer) -> Locks {
    let backend = ZkBackend::connect(&LockUrl::parse(&server.url()).unwrap())
        .await
        .expect("connect");
    Locks::with_defaults(backend.clone(), backend.default_options())
}

fn status(url: &str, name: &str) -> String {
    let bin = distlock_testkit::holder::distlock_bin().expect("the distlock binary");
    let out = Command::new(bin)
        .args(["status", "--url", url, name])
        .stdin(Stdio::null())
        .output()
        .expect("distlock status");
    assert!(
        out.status.success(),
        "distlock status failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curator_holds_then_run_no_wait_exits_75_and_status_names_holder_and_waiters() {
    let server = ZkServer::start_or_panic();
    let connect = server.addr().to_string();
    let raw = raw_client(&connect).await;
    let name = name("curator_holds");
    let mut holder = Curator::hold(&connect, &name);
    holder.wait_acquired();
    let mut waiter = Curator::hold(&connect, &name);
    let queue = wait_children(&raw, &name, 2).await;
    assert!(
        queue
            .iter()
            .all(|c| c.starts_with("_c_") && c.contains("-lock-")),
        "Curator's protected-mode names: {queue:?}"
    );

    let code = tokio::task::spawn_blocking({
        let (url, name) = (server.url(), name.clone());
        move || no_wait_run(&url, &name)
    })
    .await
    .unwrap();
    assert_eq!(code, 75, "distlock run --no-wait while Curator holds");
    // The refused attempt left no node behind.
    assert_eq!(children(&raw, &name).await.len(), 2);

    let (data, stat) = raw
        .get_data(&format!("/{name}/{}", queue[0]))
        .await
        .expect("holder node");
    let text = status(&server.url(), &name);
    assert!(text.contains("state: held"), "{text}");
    assert!(text.contains(&format!("token: {}", stat.czxid)), "{text}");
    assert!(
        text.contains(&format!("owner: {}", String::from_utf8_lossy(&data))),
        "the holder is named by its node's data (Curator writes its IP address): {text}"
    );
    assert!(text.contains("waiters: 1"), "{text}");

    holder.release();
    waiter.wait_acquired();
    waiter.release();
    assert!(children(&raw, &name).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn distlock_holds_then_curator_acquire_200ms_returns_false() {
    let server = ZkServer::start_or_panic();
    let connect = server.addr().to_string();
    let raw = raw_client(&connect).await;
    let locks = locks(&server).await;
    let name = name("distlock_holds");
    let guard = locks.lock(&name).unwrap().acquire().await.expect("acquire");
    let ours = children(&raw, &name).await;
    assert_eq!(ours.len(), 1);
    let (_, stat) = raw
        .get_data(&format!("/{name}/{}", ours[0]))
        .await
        .expect("own node");
    assert_eq!(
        guard.token().expect("token").get(),
        u64::try_from(stat.czxid).unwrap(),
        "the token is the node's czxid"
    );

    let got = tokio::task::spawn_blocking({
        let (connect, name) = (connect.clone(), name.clone());
        move || Curator::try_acquire(&connect, &name, 200)
    })
    .await
    .unwrap();
    assert!(!got, "Curator acquired a lock distlock holds");
    assert_eq!(
        children(&raw, &name).await,
        ours,
        "Curator's timed-out node was not removed"
    );

    guard.release().await.expect("release");
    let got = tokio::task::spawn_blocking({
        let (connect, name) = (connect.clone(), name.clone());
        move || Curator::try_acquire(&connect, &name, 5000)
    })
    .await
    .unwrap();
    assert!(got, "Curator could not acquire after distlock released");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_curator_and_distlock_waiters_are_served_in_creation_order() {
    let server = ZkServer::start_or_panic();
    let connect = server.addr().to_string();
    let raw = raw_client(&connect).await;
    let first = locks(&server).await;
    let second = locks(&server).await;
    let name = name("mixed_order");

    let holder = first.lock(&name).unwrap().acquire().await.expect("acquire");
    let mut curator1 = Curator::hold(&connect, &name);
    wait_children(&raw, &name, 2).await;
    let lock2 = second.lock(&name).unwrap();
    let distlock2 = tokio::spawn(async move { lock2.acquire().await });
    wait_children(&raw, &name, 3).await;
    let mut curator3 = Curator::hold(&connect, &name);
    wait_children(&raw, &name, 4).await;

    holder.release().await.expect("release");
    let curator1 = tokio::task::spawn_blocking(move || {
        curator1.wait_acquired();
        curator1
    })
    .await
    .unwrap();
    assert!(
        !distlock2.is_finished(),
        "distlock's waiter went before the earlier Curator waiter"
    );
    let mut curator1 = curator1;
    tokio::task::spawn_blocking(move || curator1.release())
        .await
        .unwrap();
    let guard2 = tokio::time::timeout(Duration::from_secs(20), distlock2)
        .await
        .expect("distlock's waiter was not served after Curator's release")
        .unwrap()
        .expect("acquire");
    assert_eq!(
        children(&raw, &name).await.len(),
        2,
        "Curator's second waiter still queued"
    );
    guard2.release().await.expect("release");
    tokio::task::spawn_blocking(move || {
        curator3.wait_acquired();
        curator3.release();
    })
    .await
    .unwrap();
    assert!(children(&raw, &name).await.is_empty());
}

/// Curator's session timeout in the kinds tests that do not kill it.
const CURATOR_SESSION: Duration = Duration::from_secs(10);

/// The czxid of `/NAME/child`.
async fn czxid(raw: &zookeeper_client::Client, name: &str, child: &str) -> u64 {
    let (_, stat) = raw
        .get_data(&format!("/{name}/{child}"))
        .await
        .expect("node");
    u64::try_from(stat.czxid).unwrap()
}

/// A `CuratorKinds` one-shot, off the async workers.
async fn curator_once(connect: &str, name: &str, args: &[&str]) -> String {
    let (connect, name) = (connect.to_string(), name.to_string());
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Curator::kinds_once(&connect, CURATOR_SESSION, &name, &args)
    })
    .await
    .unwrap()
}

/// A `CuratorKinds` holder (`read hold`, `sem 2 hold`, `downgrade621`, …) whose first line is awaited
/// (`ACQUIRED …`, `WRITE …`); returns it with that line.
async fn curator_holding(
    connect: &str,
    session: Duration,
    name: &str,
    args: &[&str],
) -> (Curator, String) {
    let (connect, name) = (connect.to_string(), name.to_string());
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut c = Curator::kinds(&connect, session, &name, &args);
        let line = c.next_line();
        (c, line)
    })
    .await
    .unwrap()
}

/// Sends the holder its line and returns the next one it prints.
async fn curator_step(mut curator: Curator) -> (Curator, String) {
    tokio::task::spawn_blocking(move || {
        curator.send_line();
        let line = curator.next_line();
        (curator, line)
    })
    .await
    .unwrap()
}

/// Curator's `InterProcessReadWriteLock` and distlock's read-write lock on one path: readers of
/// both share it, and a writer of either excludes readers and writers of the other (and distlock's
/// mutex, which is in the same queue). A distlock reader carries the last write grant's token: a
/// distlock writer's (recorded in the name node on release), or a Curator writer's it queued behind
/// (a Curator writer records nothing: the reader saw its node's czxid). `status` shows the kind and
/// each reader.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curator_and_distlock_readers_share_and_writers_exclude_both_ways() {
    let server = ZkServer::start_or_panic();
    let connect = server.addr().to_string();
    let raw = raw_client(&connect).await;
    let locks = locks(&server).await;
    let name = name("rw_interop");
    let rw = locks.read_write(&name).unwrap();
    let other = locks.read_write(&name).unwrap();

    // A Curator reader and a distlock reader share.
    let (mut curator_reader, line) =
        curator_holding(&connect, CURATOR_SESSION, &name, &["read", "hold"]).await;
    assert_eq!(line, "ACQUIRED");
    let reader = rw
        .reader()
        .try_acquire()
        .await
        .unwrap()
        .expect("a distlock reader beside a Curator reader");
    let text = status(&server.url(), &name);
    assert!(text.contains("kind: read"), "{text}");
    assert_eq!(text.matches("holder: ").count(), 2, "{text}");
    // Readers exclude distlock's writer and mutex, and Curator's writer.
    assert!(other.writer().try_acquire().await.unwrap().is_none());
    assert!(locks
        .lock(&name)
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .is_none());
    assert_eq!(
        curator_once(&connect, &name, &["write", "try", "300"]).await,
        "BUSY"
    );
    reader.release().await.unwrap();
    tokio::task::spawn_blocking(move || curator_reader.release())
        .await
        .unwrap();

    // A distlock writer excludes Curator's readers and writers; a reader after it carries its token.
    let writer = other.write().await.unwrap();
    let write_token = writer.token().unwrap().get();
    assert_eq!(
        curator_once(&connect, &name, &["read", "try", "300"]).await,
        "BUSY"
    );
    assert_eq!(
        curator_once(&connect, &name, &["write", "try", "300"]).await,
        "BUSY"
    );
    writer.release().await.unwrap();
    let reader = rw.read().await.unwrap();
    assert_eq!(
        reader.token().unwrap().get(),
        write_token,
        "the last write's token"
    );
    reader.release().await.unwrap();

    // A Curator writer excludes distlock's readers and writers; a distlock reader queued behind it
    // carries its node's czxid once it is in.
    let (mut curator_writer, line) =
        curator_holding(&connect, CURATOR_SESSION, &name, &["write", "hold"]).await;
    assert_eq!(line, "ACQUIRED");
    let curator_node = wait_children(&raw, &name, 1).await.remove(0);
    let curator_token = czxid(&raw, &name, &curator_node).await;
    assert!(curator_token > write_token);
    assert!(rw.reader().try_acquire().await.unwrap().is_none());
    assert!(other.writer().try_acquire().await.unwrap().is_none());
    let queued = {
        let rw = locks.read_write(&name).unwrap();
        tokio::spawn(async move {
            rw.reader()
                .options()
                .wait(Duration::from_secs(20))
                .acquire()
                .await
        })
    };
    wait_children(&raw, &name, 2).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !queued.is_finished(),
        "a distlock reader got in beside a Curator writer"
    );
    tokio::task::spawn_blocking(move || curator_writer.release())
        .await
        .unwrap();
    let reader = queued
        .await
        .unwrap()
        .expect("the reader once Curator's writer left");
    assert_eq!(
        reader.token().unwrap().get(),
        curator_token,
        "a reader carries the Curator write grant it queued behind"
    );
    reader.release().await.unwrap();
    assert!(children(&raw, &name).await.is_empty());
}

/// Curator's downgrades, as 5.5 makes them (CURATOR-621: a plain ephemeral `__READ__` node with the
/// writer's sequence, created with Curator's own create builder: Debian ships 5.4) and as 5.4 makes
/// them (a sequential read node after the writer's): distlock readers share with the downgraded
/// reader, distlock writers wait for it, and a distlock writer queued behind the 5.5 node stays out
/// until the Curator reader leaves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curator_downgrades_let_distlock_readers_in_and_keep_writers_out() {
    let server = ZkServer::start_or_panic();
    let connect = server.addr().to_string();
    let raw = raw_client(&connect).await;
    let locks = locks(&server).await;
    let name = name("curator_downgrade");
    let rw = locks.read_write(&name).unwrap();
    let writer_rw = locks.read_write(&name).unwrap();

    for mode in ["downgrade621", "downgrade"] {
        let (curator, line) = curator_holding(&connect, CURATOR_SESSION, &name, &[mode]).await;
        assert!(line.starts_with("WRITE "), "{mode}: {line}");
        let write_node = line["WRITE ".len()..].to_string();
        assert!(rw.reader().try_acquire().await.unwrap().is_none(), "{mode}");
        let (curator, line) = curator_step(curator).await;
        assert!(line.starts_with("DOWNGRADED"), "{mode}: {line}");
        let nodes = wait_children(&raw, &name, 1).await;
        let read_node = &nodes[0];
        assert!(read_node.contains("__READ__"), "{mode}: {nodes:?}");
        if mode == "downgrade621" {
            assert_eq!(
                distlock_zookeeper::layout::sequence(read_node),
                distlock_zookeeper::layout::sequence(&write_node),
                "the 5.5 node takes the writer's sequence"
            );
        }
        let reader = rw.reader().try_acquire().await.unwrap().unwrap_or_else(|| {
            panic!("{mode}: a distlock reader beside Curator's downgraded reader")
        });
        assert!(
            writer_rw.writer().try_acquire().await.unwrap().is_none(),
            "{mode}"
        );
        reader.release().await.unwrap();
        let queued = {
            let rw = locks.read_write(&name).unwrap();
            tokio::spawn(async move {
                rw.writer()
                    .options()
                    .wait(Duration::from_secs(20))
                    .acquire()
                    .await
            })
        };
        wait_children(&raw, &name, 2).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(
            !queued.is_finished(),
            "{mode}: a writer got in beside Curator's downgraded reader"
        );
        let (_curator, line) = curator_step(curator).await;
        assert_eq!(line, "RELEASED");
        let writer = tokio::time::timeout(Duration::from_secs(10), queued)
            .await
            .expect("the writer once Curator's reader left")
            .unwrap()
            .unwrap();
        writer.release().await.unwrap();
        assert!(children(&raw, &name).await.is_empty(), "{mode}");
    }
}

/// distlock's downgrade is Curator 5.5's node: the write node goes and a plain ephemeral
/// `_c_<uuid>-__READ__<the writer's sequence>` takes its place in one step, the token recorded in the
/// name node. A Curator writer queued behind the writer stays out (CURATOR-621), a Curator reader
/// shares, and the Curator writer gets in once the downgraded reader leaves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn distlock_downgrade_makes_curators_node_and_keeps_a_queued_curator_writer_out() {
    let server = ZkServer::start_or_panic();
    let connect = server.addr().to_string();
    let raw = raw_client(&connect).await;
    let locks = locks(&server).await;
    let name = name("distlock_downgrade");
    let rw = locks.read_write(&name).unwrap();
    let mut guard = rw.write().await.unwrap();
    let write_node = wait_children(&raw, &name, 1).await.remove(0);
    let token = guard.token().unwrap().get();
    let mut curator_writer = tokio::task::spawn_blocking({
        let (connect, name) = (connect.clone(), name.clone());
        move || Curator::kinds(&connect, CURATOR_SESSION, &name, &["write", "hold"])
    })
    .await
    .unwrap();
    let queue = wait_children(&raw, &name, 2).await;
    let curator_node = queue.iter().find(|c| **c != write_node).unwrap().clone();

    guard.downgrade().await.expect("downgrade");
    let nodes = children(&raw, &name).await;
    let read_node = nodes.iter().find(|c| **c != curator_node).unwrap();
    assert!(
        !nodes.contains(&write_node),
        "the write node is gone: {nodes:?}"
    );
    assert!(
        read_node.starts_with("_c_") && read_node.contains("-__READ__"),
        "{nodes:?}"
    );
    assert_eq!(
        distlock_zookeeper::layout::sequence(read_node),
        distlock_zookeeper::layout::sequence(&write_node)
    );
    let (_, stat) = raw.get_data(&format!("/{name}/{read_node}")).await.unwrap();
    assert!(
        stat.ephemeral_owner > 0,
        "an ephemeral node (a session id as owner)"
    );
    assert_eq!(
        raw.get_data(&format!("/{name}")).await.unwrap().0,
        distlock_zookeeper::layout::write_record(i64::try_from(token).unwrap()),
        "the write's token is recorded in the name node"
    );
    assert_eq!(guard.token().unwrap().get(), token);

    let (waited, curator_writer_back) = tokio::task::spawn_blocking(move || {
        let line = curator_writer.line_within(Duration::from_secs(1));
        (line, curator_writer)
    })
    .await
    .unwrap();
    curator_writer = curator_writer_back;
    assert_eq!(
        waited, None,
        "Curator's queued writer got in beside the downgraded reader"
    );
    assert_eq!(
        curator_once(&connect, &name, &["read", "try", "1000"]).await,
        "BUSY",
        "a Curator reader queues behind Curator's earlier writer (FIFO)"
    );
    guard.release().await.unwrap();
    tokio::task::spawn_blocking(move || {
        curator_writer.wait_acquired();
        curator_writer.release();
    })
    .await
    .unwrap();
    assert!(children(&raw, &name).await.is_empty());
}

/// Curator's `InterProcessSemaphoreV2` and distlock's permits on one path count against one limit:
/// distlock stores it in `<path>/limit` as Curator's `SharedCount` writes it (a Curator semaphore
/// built on that `SharedCount` reads it), the lease nodes are Curator's, a waiter of either side gets
/// the permit the other returns, and the name's mutex is refused while permits are held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curator_semaphore_and_distlock_permits_count_against_one_limit() {
    let server = ZkServer::start_or_panic();
    let connect = server.addr().to_string();
    let raw = raw_client(&connect).await;
    let locks = locks(&server).await;
    let name = name("sem_interop");
    let semaphore = locks.semaphore(&name, 2).unwrap();

    let first = semaphore.try_acquire().await.unwrap().expect("a permit");
    let leases = children(&raw, &format!("{name}/leases")).await;
    assert_eq!(leases.len(), 1);
    assert_eq!(
        first.permit(),
        Some(leases[0].as_str()),
        "the permit is its lease node"
    );
    assert_eq!(
        first.token().unwrap().get(),
        czxid(&raw, &format!("{name}/leases"), &leases[0]).await
    );
    assert_eq!(
        raw.get_data(&format!("/{name}/limit")).await.unwrap().0,
        [0, 0, 0, 2],
        "SharedCount's format"
    );

    let (curator_holder, line) =
        curator_holding(&connect, CURATOR_SESSION, &name, &["sem", "2", "hold"]).await;
    assert!(
        line.starts_with("ACQUIRED _c_") && line.contains("-lease-"),
        "{line}"
    );
    assert!(
        semaphore.try_acquire().await.unwrap().is_none(),
        "a third permit of 2"
    );
    assert_eq!(
        curator_once(&connect, &name, &["sem", "2", "try", "300"]).await,
        "BUSY"
    );
    assert_eq!(
        curator_once(&connect, &name, &["semshared", "try", "300"]).await,
        "LIMIT 2 BUSY",
        "a Curator semaphore on the SharedCount reads distlock's limit"
    );
    let refused = locks.lock(&name).unwrap().try_acquire().await;
    assert_eq!(
        refused.as_ref().err().map(|e| e.kind()),
        Some(distlock_core::ErrorKind::KindConflict),
        "{refused:?}"
    );
    let text = status(&server.url(), &name);
    assert!(
        text.contains("kind: semaphore") && text.contains("permits: 2"),
        "{text}"
    );
    assert_eq!(text.matches("permit: _c_").count(), 2, "{text}");

    // A distlock waiter gets the permit Curator returns.
    let waiter = {
        let semaphore = locks.semaphore(&name, 2).unwrap();
        tokio::spawn(async move {
            semaphore
                .permit()
                .options()
                .wait(Duration::from_secs(20))
                .acquire()
                .await
        })
    };
    wait_children(&raw, &format!("{name}/leases"), 3).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiter.is_finished(), "a third permit of 2");
    let (_curator, line) = curator_step(curator_holder).await;
    assert_eq!(line, "RELEASED");
    let second = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("the permit Curator returned")
        .unwrap()
        .unwrap();
    assert!(second.token().unwrap() > first.token().unwrap());

    // A Curator waiter gets the permit distlock returns.
    let mut curator_waiter = tokio::task::spawn_blocking({
        let (connect, name) = (connect.clone(), name.clone());
        move || Curator::kinds(&connect, CURATOR_SESSION, &name, &["semshared", "hold"])
    })
    .await
    .unwrap();
    wait_children(&raw, &format!("{name}/leases"), 3).await;
    first.release().await.unwrap();
    let line = tokio::task::spawn_blocking(move || {
        let limit = curator_waiter.next_line();
        let acquired = curator_waiter.next_line();
        curator_waiter.send_line();
        assert_eq!(curator_waiter.next_line(), "RELEASED");
        format!("{limit} {acquired}")
    })
    .await
    .unwrap();
    assert!(line.starts_with("LIMIT 2 ACQUIRED _c_"), "{line}");
    second.release().await.unwrap();
    assert!(children(&raw, &format!("{name}/leases")).await.is_empty());
    let mismatch = locks.semaphore(&name, 3).unwrap().try_acquire().await;
    assert_eq!(
        mismatch.as_ref().err().map(|e| e.kind()),
        Some(distlock_core::ErrorKind::LimitMismatch {
            stored: 2,
            requested: 3
        }),
        "{mismatch:?}"
    );
}

/// A killed holder's session frees its reader or permit once the server expires it, both ways: a
/// SIGKILLed Curator reader / permit holder (2 s session) lets a distlock writer / permit waiter in,
/// a SIGKILLed `distlock run --read` / `--permits 1` (2 s lease) lets a Curator writer / permit waiter
/// in, each within the session timeout (and the test's slack), never before the kill.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_killed_sessions_free_a_reader_and_a_permit_within_the_session_timeout() {
    let server = ZkServer::start_or_panic();
    let connect = server.addr().to_string();
    let locks = locks(&server).await;
    let session = Duration::from_secs(2);
    let bound = session + Duration::from_secs(8);

    for (kind, curator_args) in [
        ("read", ["read", "hold"].as_slice()),
        ("permit", &["sem", "1", "hold"]),
    ] {
        // Curator holds and is killed; distlock waits.
        let lock_name = name(&format!("killed_curator_{kind}"));
        let (mut curator, line) =
            curator_holding(&connect, session, &lock_name, curator_args).await;
        assert!(line.starts_with("ACQUIRED"), "{line}");
        let waiter = if kind == "read" {
            let rw = locks.read_write(&lock_name).unwrap();
            tokio::spawn(async move {
                rw.writer()
                    .options()
                    .wait(Duration::from_secs(30))
                    .acquire()
                    .await
            })
        } else {
            let semaphore = locks.semaphore(&lock_name, 1).unwrap();
            tokio::spawn(async move {
                semaphore
                    .permit()
                    .options()
                    .wait(Duration::from_secs(30))
                    .acquire()
                    .await
            })
        };
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!waiter.is_finished(), "{kind}: in beside Curator's holder");
        tokio::task::spawn_blocking(move || curator.kill9())
            .await
            .unwrap();
        let killed = std::time::Instant::now();
        let guard = tokio::time::timeout(bound, waiter)
            .await
            .unwrap_or_else(|_| panic!("{kind}: not freed within {bound:?} of the kill"))
            .unwrap()
            .unwrap();
        eprintln!(
            "{kind}: Curator's killed holder freed {:?} after the kill",
            killed.elapsed()
        );
        guard.release().await.unwrap();

        // distlock holds and is killed; Curator waits.
        let lock_name = name(&format!("killed_distlock_{kind}"));
        let flags: &[&str] = if kind == "read" {
            &["--read"]
        } else {
            &["--permits", "1"]
        };
        let mut holder = tokio::task::spawn_blocking({
            let (url, name, flags) = (server.url(), lock_name.clone(), flags.to_vec());
            move || {
                distlock_testkit::holder::HolderProcess::spawn_with(&url, &name, session, &flags)
                    .unwrap()
            }
        })
        .await
        .unwrap();
        let curator_args: &[&str] = if kind == "read" {
            &["write", "hold"]
        } else {
            &["sem", "1", "hold"]
        };
        let waiting = tokio::task::spawn_blocking({
            let (connect, name) = (connect.clone(), lock_name.clone());
            let args: Vec<String> = curator_args.iter().map(|a| a.to_string()).collect();
            move || {
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                let mut c = Curator::kinds(&connect, CURATOR_SESSION, &name, &args);
                let early = c.line_within(Duration::from_secs(3));
                (c, early)
            }
        })
        .await
        .unwrap();
        let (mut curator, early) = waiting;
        assert_eq!(
            early, None,
            "{kind}: Curator got in beside distlock's holder"
        );
        tokio::task::spawn_blocking(move || holder.kill9().unwrap())
            .await
            .unwrap();
        let killed = std::time::Instant::now();
        let line = tokio::task::spawn_blocking(move || {
            let line = curator.line_within(bound);
            if line.is_some() {
                curator.send_line();
            }
            line
        })
        .await
        .unwrap();
        assert!(
            line.as_deref().is_some_and(|l| l.starts_with("ACQUIRED")),
            "{kind}: Curator not in within {bound:?} of the kill: {line:?}"
        );
        eprintln!(
            "{kind}: distlock's killed holder freed {:?} after the kill",
            killed.elapsed()
        );
    }
}

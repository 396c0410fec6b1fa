//! Helpers shared by the ZooKeeper test binaries: the real `distlock` binary (`Run`, from the
//! testkit), a raw ZooKeeper client to look at the lock's children, and Curator through a
//! small Java program compiled at test time (`Curator`).
#![allow(dead_code, clippy::expect_used, clippy::unwrap_used)]

use std::io::{BufRead, BufReader, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use zookeeper_client as zk;

/// A unique lock name for one test case (a path: `zk-test/<case>/<id>`).
pub fn name(case: &str) -> String {
    format!(
        "zk-test/{case}/{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    )
}

/// A `Locks` on a ZooKeeper backend connected as `url` says, with the backend's default lease.
pub async fn locks_at(url: &str) -> distlock_core::Locks {
    let url = distlock_core::url::LockUrl::parse(url).unwrap();
    let backend = distlock_zookeeper::ZkBackend::connect(&url)
        .await
        .expect("connect");
    distlock_core::Locks::with_defaults(backend.clone(), backend.default_options())
}

/// A plain client on `connect` (`h:p[,h:p]`), as an operator's zkCli would be.
pub async fn raw_client(connect: &str) -> zk::Client {
    zk::Client::connector()
        .with_session_timeout(Duration::from_secs(10))
        .connect(connect)
        .await
        .expect("raw ZooKeeper client")
}

/// The children of `/NAME` in Curator's order (empty if the node is absent).
pub async fn children(client: &zk::Client, name: &str) -> Vec<String> {
    let mut c = match client.list_children(&format!("/{name}")).await {
        Ok(c) => c,
        Err(zk::Error::NoNode) => Vec::new(),
        Err(e) => panic!("getChildren /{name}: {e}"),
    };
    distlock_zookeeper::layout::sort_children(&mut c);
    c
}

/// Waits (20 s at most) until `/NAME` has `n` children; returns them.
pub async fn wait_children(client: &zk::Client, name: &str, n: usize) -> Vec<String> {
    let started = Instant::now();
    loop {
        let c = children(client, name).await;
        if c.len() == n {
            return c;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "/{name} has {} children, not {n}: {c:?}",
            c.len()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The jars the Java program needs (Debian's Curator 5 and ZooKeeper 3.8 client).
const JARS: &[&str] = &[
    "curator-client",
    "curator-framework",
    "curator-recipes",
    "zookeeper",
    "zookeeper-jute",
    "guava",
    "slf4j-api",
    "slf4j-nop",
];
const CURATOR_HINT: &str = "install them with `apt-get install -y libcurator-recipes-java libcurator-framework-java libcurator-client-java libzookeeper-java libslf4j-java default-jdk-headless` (or run scripts/setup.sh)";

fn classpath() -> String {
    JARS.iter()
        .map(|j| format!("/usr/share/java/{j}.jar"))
        .collect::<Vec<_>>()
        .join(":")
}

/// The Java programs, compiled together.
const SOURCES: &[&str] = &["CuratorLock.java", "CuratorKinds.java"];

/// Compiles tests/java/*.java (`SOURCES`) once per test binary into target/…/curator-interop; returns
/// the class dir.
fn compiled() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        for jar in JARS {
            let path = format!("/usr/share/java/{jar}.jar");
            assert!(
                Path::new(&path).exists(),
                "{path} is missing: {CURATOR_HINT}"
            );
        }
        let sources: Vec<PathBuf> = SOURCES
            .iter()
            .map(|s| {
                Path::new(env!("CARGO_MANIFEST_DIR"))
                    .join("tests/java")
                    .join(s)
            })
            .collect();
        let text: Vec<u8> = sources
            .iter()
            .flat_map(|s| std::fs::read(s).unwrap_or_else(|e| panic!("{}: {e}", s.display())))
            .collect();
        // Keyed by the sources, so the test processes (nextest runs one per test) compile them once.
        let hash = text.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3)
        });
        let exe = std::env::current_exe().expect("test binary");
        let deps = exe.parent().expect("deps dir");
        let dir = deps.join(format!("curator-interop-{hash:016x}"));
        if dir.join("CuratorKinds.class").exists() {
            return dir;
        }
        let scratch = deps.join(format!(
            "curator-interop-{hash:016x}.{}",
            std::process::id()
        ));
        std::fs::create_dir_all(&scratch).expect("class dir");
        let out = Command::new("javac")
            .args(["-cp", &classpath(), "-d"])
            .arg(&scratch)
            .args(&sources)
            .output()
            .unwrap_or_else(|e| panic!("running javac ({e}): {CURATOR_HINT}"));
        assert!(
            out.status.success(),
            "javac failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        // Another process may have won the race; either copy is complete.
        if std::fs::rename(&scratch, &dir).is_err() {
            let _ = std::fs::remove_dir_all(&scratch);
        }
        dir
    })
}

/// A Curator client in its own JVM: `InterProcessMutex` (`CuratorLock.java`), or the read-write lock
/// and semaphore (`CuratorKinds.java`, [`Curator::kinds`]).
pub struct Curator {
    child: Child,
    stdin: Option<ChildStdin>,
    /// Its output lines that are not `#` comments, read by a thread of their own (so a test can wait
    /// for one with a bound).
    lines: std::sync::mpsc::Receiver<String>,
}

impl Curator {
    fn spawn(connect: &str, name: &str, mode: &[&str]) -> Curator {
        Self::spawn_class("CuratorLock", &[connect, &format!("/{name}")], mode)
    }

    /// `CuratorKinds <connect> <session ms> /NAME args…` (see tests/java/CuratorKinds.java): `read
    /// hold`, `write try 300`, `downgrade621`, `sem 2 hold`, `semshared try 300`, …
    pub fn kinds(connect: &str, session: Duration, name: &str, args: &[&str]) -> Curator {
        let session_ms = session.as_millis().to_string();
        Self::spawn_class(
            "CuratorKinds",
            &[connect, &session_ms, &format!("/{name}")],
            args,
        )
    }

    /// Runs a `CuratorKinds` one-shot (a `try`) to its end; returns its first line (`ACQUIRED …`,
    /// `BUSY`, or `LIMIT n` then the next is read too and both returned, space-joined).
    pub fn kinds_once(connect: &str, session: Duration, name: &str, args: &[&str]) -> String {
        let mut c = Self::kinds(connect, session, name, args);
        let mut line = c.next_line();
        if line.starts_with("LIMIT ") {
            line = format!("{line} {}", c.next_line());
        }
        let _ = c.child.wait();
        line
    }

    fn spawn_class(class: &str, head: &[&str], mode: &[&str]) -> Curator {
        let cp = format!("{}:{}", compiled().display(), classpath());
        let mut child = Command::new("java")
            .args([
                "-Xms16m",
                "-Xmx64m",
                "-XX:+UseSerialGC",
                "-XX:TieredStopAtLevel=1",
                "-cp",
                &cp,
                class,
            ])
            .args(head)
            .args(mode)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("running java ({e}): {CURATOR_HINT}"));
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let (send, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || read_lines(stdout, &send));
        Curator {
            child,
            stdin,
            lines,
        }
    }

    /// `acquire()` and hold until [`release`](Self::release).
    pub fn hold(connect: &str, name: &str) -> Curator {
        Self::spawn(connect, name, &["hold"])
    }

    /// `acquire(ms, MILLISECONDS)`: whether it got the lock.
    pub fn try_acquire(connect: &str, name: &str, ms: u64) -> bool {
        let mut c = Self::spawn(connect, name, &["try", &ms.to_string()]);
        let line = c.next_line();
        let _ = c.child.wait();
        match line.as_str() {
            "ACQUIRED" => true,
            "BUSY" => false,
            other => panic!("CuratorLock try printed {other:?}"),
        }
    }

    /// The next line that is not a `#` comment (blocking).
    pub fn next_line(&mut self) -> String {
        self.lines
            .recv()
            .unwrap_or_else(|_| panic!("the Curator program exited early"))
    }

    /// The next line that is not a `#` comment, if one comes within `within`.
    pub fn line_within(&mut self, within: Duration) -> Option<String> {
        match self.lines.recv_timeout(within) {
            Ok(line) => Some(line),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => None,
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                panic!("the Curator program exited early")
            }
        }
    }

    /// Blocks until Curator says it holds the lock.
    pub fn wait_acquired(&mut self) {
        assert_eq!(self.next_line(), "ACQUIRED");
    }

    /// Sends a line (the programs' "go on": release, downgrade).
    pub fn send_line(&mut self) {
        if let Some(stdin) = self.stdin.as_mut() {
            let _ = writeln!(stdin, "go");
            let _ = stdin.flush();
        }
    }

    /// SIGKILLs the JVM: its session is left to expire on the server.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Releases the lock and waits for the JVM to exit.
    pub fn release(&mut self) {
        if let Some(mut stdin) = self.stdin.take() {
            let _ = writeln!(stdin, "release");
        }
        assert_eq!(self.next_line(), "RELEASED");
        let _ = self.child.wait();
    }
}

impl Drop for Curator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sends `stdout`'s lines that are not `#` comments, trimmed, until it ends.
fn read_lines(mut stdout: BufReader<ChildStdout>, send: &std::sync::mpsc::Sender<String>) {
    loop {
        let mut line = String::new();
        match stdout.read_line(&mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {
                let line = line.trim().to_string();
                if !line.starts_with('#') && send.send(line).is_err() {
                    return;
                }
            }
        }
    }
}

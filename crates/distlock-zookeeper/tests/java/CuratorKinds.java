// Curator's read-write lock and semaphore for distlock's interop tests, compiled at test time with javac
// against Debian's Curator jars (libcurator-*-java 5.4), like CuratorLock.java.
//
//   java CuratorKinds <connect> <session ms> <path> read|write hold
//       InterProcessReadWriteLock's readLock()/writeLock().acquire() (waiting as long as it takes), print
//       "ACQUIRED", release when a line arrives on stdin (or stdin closes), print "RELEASED", exit 0.
//   java CuratorKinds <connect> <session ms> <path> read|write try <ms>
//       acquire(ms, MILLISECONDS): print "ACQUIRED" (and release) or "BUSY".
//   java CuratorKinds <connect> <session ms> <path> downgrade
//       Curator 5.4's downgrade: writeLock().acquire(), print "WRITE"; on a line, readLock().acquire()
//       (held at once: this thread owns the write lock; a sequential __READ__ node after the writer's),
//       writeLock().release(), print "DOWNGRADED"; on a line, release the read lock, print "RELEASED".
//   java CuratorKinds <connect> <session ms> <path> downgrade621
//       Curator 5.5's downgrade (CURATOR-621; Debian ships 5.4, which predates it): as `downgrade`, but
//       the read lock's node is created as 5.5's StandardLockInternalsDriver.createsTheLock creates it
//       for ReadLock.getSortingSequence(): with Curator's own create builder, protected, a plain
//       EPHEMERAL node at <path>/__READ__<the writer's sequence>.
//   java CuratorKinds <connect> <session ms> <path> sem <n> hold | sem <n> try <ms>
//       InterProcessSemaphoreV2(client, path, n): acquire() or acquire(ms): "ACQUIRED <lease node>" or
//       "BUSY"; a held lease is returned on a line, "RELEASED".
//   java CuratorKinds <connect> <session ms> <path> semshared hold | semshared try <ms>
//       The same with the limit read from a SharedCount at <path>/limit (distlock's stored limit):
//       prints "LIMIT <n>" first.
//
// Everything else it prints starts with "#". Exit 2 on bad usage, 1 on an error.
import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.util.concurrent.TimeUnit;

import org.apache.curator.framework.CuratorFramework;
import org.apache.curator.framework.CuratorFrameworkFactory;
import org.apache.curator.framework.recipes.locks.InterProcessMutex;
import org.apache.curator.framework.recipes.locks.InterProcessReadWriteLock;
import org.apache.curator.framework.recipes.locks.InterProcessSemaphoreV2;
import org.apache.curator.framework.recipes.locks.Lease;
import org.apache.curator.framework.recipes.locks.StandardLockInternalsDriver;
import org.apache.curator.framework.recipes.shared.SharedCount;
import org.apache.curator.retry.RetryOneTime;
import org.apache.curator.utils.ZKPaths;
import org.apache.zookeeper.CreateMode;

public class CuratorKinds {
    static final BufferedReader IN = new BufferedReader(new InputStreamReader(System.in));

    static void say(String line) {
        System.out.println(line);
        System.out.flush();
    }

    static void awaitLine() throws Exception {
        IN.readLine();
    }

    /** The write lock, with its node's path in reach (`getLockPath` is protected in 5.4). */
    static class WriteLock extends InterProcessReadWriteLock.WriteLock {
        WriteLock(CuratorFramework client, String path) {
            super(client, path, null);
        }

        String nodePath() {
            return getLockPath();
        }
    }

    public static void main(String[] args) throws Exception {
        if (args.length < 4) {
            System.err.println("usage: CuratorKinds <connect> <session ms> <path> <mode> ...");
            System.exit(2);
        }
        CuratorFramework client = CuratorFrameworkFactory.builder()
                .connectString(args[0])
                .sessionTimeoutMs(Integer.parseInt(args[1]))
                .connectionTimeoutMs(10000)
                .retryPolicy(new RetryOneTime(100))
                .build();
        client.start();
        client.blockUntilConnected();
        String path = args[2];
        String mode = args[3];
        try {
            if (mode.equals("read") || mode.equals("write")) {
                InterProcessReadWriteLock rw = new InterProcessReadWriteLock(client, path);
                InterProcessMutex lock = mode.equals("read") ? rw.readLock() : rw.writeLock();
                run(lock, args, 4);
            } else if (mode.equals("downgrade") || mode.equals("downgrade621")) {
                WriteLock write = new WriteLock(client, path);
                write.acquire();
                say("WRITE " + ZKPaths.getNodeFromPath(write.nodePath()));
                awaitLine();
                if (mode.equals("downgrade")) {
                    InterProcessReadWriteLock.ReadLock read =
                            new InterProcessReadWriteLock.ReadLock(client, path, null, write);
                    read.acquire();
                    write.release();
                    say("DOWNGRADED");
                    awaitLine();
                    read.release();
                } else {
                    String sequence = StandardLockInternalsDriver.standardFixForSorting(write.nodePath(), "__WRIT__");
                    String readNode = client.create()
                            .creatingParentContainersIfNeeded()
                            .withProtection()
                            .withMode(CreateMode.EPHEMERAL)
                            .forPath(ZKPaths.makePath(path, "__READ__") + sequence);
                    write.release();
                    say("DOWNGRADED " + ZKPaths.getNodeFromPath(readNode));
                    awaitLine();
                    client.delete().guaranteed().forPath(readNode);
                }
                say("RELEASED");
            } else if (mode.equals("sem") || mode.equals("semshared")) {
                InterProcessSemaphoreV2 semaphore;
                int rest;
                if (mode.equals("sem")) {
                    semaphore = new InterProcessSemaphoreV2(client, path, Integer.parseInt(args[4]));
                    rest = 5;
                } else {
                    SharedCount count = new SharedCount(client, ZKPaths.makePath(path, "limit"), 0);
                    count.start();
                    say("LIMIT " + count.getCount());
                    semaphore = new InterProcessSemaphoreV2(client, path, count);
                    rest = 4;
                }
                Lease lease;
                if (args[rest].equals("hold")) {
                    say("# waiting");
                    lease = semaphore.acquire();
                } else {
                    lease = semaphore.acquire(Long.parseLong(args[rest + 1]), TimeUnit.MILLISECONDS);
                }
                if (lease == null) {
                    say("BUSY");
                } else {
                    say("ACQUIRED " + lease.getNodeName());
                    if (args[rest].equals("hold")) {
                        awaitLine();
                    }
                    semaphore.returnLease(lease);
                    say("RELEASED");
                }
            } else {
                System.err.println("unknown mode " + mode);
                System.exit(2);
            }
        } catch (Exception e) {
            e.printStackTrace();
            System.exit(1);
        } finally {
            client.close();
        }
    }

    static void run(InterProcessMutex lock, String[] args, int at) throws Exception {
        if (args[at].equals("hold")) {
            say("# waiting");
            lock.acquire();
            say("ACQUIRED");
            awaitLine();
            lock.release();
            say("RELEASED");
        } else if (args[at].equals("try")) {
            if (lock.acquire(Long.parseLong(args[at + 1]), TimeUnit.MILLISECONDS)) {
                say("ACQUIRED");
                lock.release();
            } else {
                say("BUSY");
            }
        } else {
            System.err.println("unknown mode " + args[at]);
            System.exit(2);
        }
    }
}

// A Curator InterProcessMutex client for distlock's interop tests, compiled at test time with javac
// against Debian's Curator jars (libcurator-*-java 5.x).
//
//   java CuratorLock <connect string> <lock path> hold
//       acquire() (waiting as long as it takes), print "ACQUIRED", then release when a line arrives on
//       stdin (or stdin closes), print "RELEASED", exit 0.
//   java CuratorLock <connect string> <lock path> try <ms>
//       acquire(ms, MILLISECONDS): print "ACQUIRED" (and release) or "BUSY", exit 0.
//
// Everything else it prints starts with "#". Exit 2 on bad usage, 1 on an error.
import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.util.concurrent.TimeUnit;

import org.apache.curator.framework.CuratorFramework;
import org.apache.curator.framework.CuratorFrameworkFactory;
import org.apache.curator.framework.recipes.locks.InterProcessMutex;
import org.apache.curator.retry.RetryOneTime;

public class CuratorLock {
    public static void main(String[] args) throws Exception {
        if (args.length < 3) {
            System.err.println("usage: CuratorLock <connect> <path> hold | try <ms>");
            System.exit(2);
        }
        CuratorFramework client = CuratorFrameworkFactory.builder()
                .connectString(args[0])
                .sessionTimeoutMs(10000)
                .connectionTimeoutMs(10000)
                .retryPolicy(new RetryOneTime(100))
                .build();
        client.start();
        client.blockUntilConnected();
        InterProcessMutex mutex = new InterProcessMutex(client, args[1]);
        try {
            if (args[2].equals("hold")) {
                System.out.println("# waiting");
                System.out.flush();
                mutex.acquire();
                System.out.println("ACQUIRED");
                System.out.flush();
                new BufferedReader(new InputStreamReader(System.in)).readLine();
                mutex.release();
                System.out.println("RELEASED");
            } else if (args[2].equals("try") && args.length == 4) {
                if (mutex.acquire(Long.parseLong(args[3]), TimeUnit.MILLISECONDS)) {
                    System.out.println("ACQUIRED");
                    mutex.release();
                } else {
                    System.out.println("BUSY");
                }
            } else {
                System.err.println("unknown mode " + args[2]);
                System.exit(2);
            }
            System.out.flush();
        } catch (Exception e) {
            e.printStackTrace();
            System.exit(1);
        } finally {
            client.close();
        }
    }
}

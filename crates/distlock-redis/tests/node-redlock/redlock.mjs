// node-redlock (npm `redlock` v5 with ioredis) for distlock's interop tests (tests/redlock_interop.rs).
//
//   node redlock.mjs hold PORTS NAME TTL_MS   acquire (no retries), print "held <value>", keep the lock
//                                             (extended by node-redlock) until stdin closes, release,
//                                             print "released"
//   node redlock.mjs try PORTS NAME TTL_MS    one acquire with retryCount 0: print "acquired" and
//                                             release (exit 0), or print "busy" (exit 3)
//
// PORTS is a comma-separated list of ports on 127.0.0.1. Any other failure exits 1.
import Redis from "ioredis";
import Redlock, { ExecutionError } from "redlock";

const [mode, ports, name, ttlText] = process.argv.slice(2);
const ttl = Number(ttlText);
const clients = ports
  .split(",")
  .map((p) => new Redis({ host: "127.0.0.1", port: Number(p), maxRetriesPerRequest: 0, enableOfflineQueue: true }));
const redlock = new Redlock(clients, { retryCount: 0, driftFactor: 0.01 });

async function quit() {
  await Promise.all(clients.map((c) => c.quit().catch(() => {})));
}

try {
  if (mode === "hold") {
    let lock = await redlock.acquire([name], ttl);
    console.log(`held ${lock.value}`);
    const timer = setInterval(async () => {
      try {
        lock = await lock.extend(ttl);
      } catch (e) {
        console.log(`extend failed: ${e}`);
      }
    }, ttl / 3);
    process.stdin.resume();
    await new Promise((resolve) => process.stdin.on("end", resolve));
    clearInterval(timer);
    await lock.release();
    console.log("released");
  } else if (mode === "try") {
    try {
      const lock = await redlock.acquire([name], ttl);
      console.log("acquired");
      await lock.release();
    } catch (e) {
      if (e instanceof ExecutionError) {
        console.log("busy");
        await quit();
        process.exit(3);
      }
      throw e;
    }
  } else {
    throw new Error(`unknown mode ${mode}`);
  }
  await quit();
  process.exit(0);
} catch (e) {
  console.error(`node-redlock: ${e && e.stack ? e.stack : e}`);
  await quit();
  process.exit(1);
}

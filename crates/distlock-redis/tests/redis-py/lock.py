"""redis-py's own Lock (Debian's python3-redis), driven by the plain-layout interop tests.

    lock.py hold PORT NAME TIMEOUT_MS   acquire (blocking), print "held <token>", release when stdin closes
    lock.py try PORT NAME TIMEOUT_MS    one non-blocking acquire: exit 0 if acquired (and released), 3 if not
    lock.py wait PORT NAME TIMEOUT_MS   acquire, blocking up to 30 s with redis-py's 0.1 s sleep; print
                                        "held <token>" and release at once; exit 3 if it timed out
"""
import sys

import redis


def main():
    command, port, name, timeout_ms = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    client = redis.Redis(host="127.0.0.1", port=port)
    lock = client.lock(name, timeout=timeout_ms / 1000.0)
    if command == "hold":
        if not lock.acquire(blocking=True, blocking_timeout=30):
            sys.exit(3)
        print("held", lock.local.token.decode(), flush=True)
        sys.stdin.read()
        lock.release()
        print("released", flush=True)
    elif command == "try":
        if not lock.acquire(blocking=False):
            sys.exit(3)
        lock.release()
    elif command == "wait":
        if not lock.acquire(blocking=True, blocking_timeout=30):
            sys.exit(3)
        print("held", lock.local.token.decode(), flush=True)
        lock.release()
    else:
        sys.exit("unknown command " + command)


if __name__ == "__main__":
    main()

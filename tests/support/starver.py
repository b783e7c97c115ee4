"""A process that starves another of CPU, for the tests of the client's self-check."""

# Stops process argv[1] for 100 ms, lets it run 10 ms, until killed. At real-time
# priority where the process may take it (root, CAP_SYS_NICE), so that its wake-ups are
# on time however loaded the machine is; it sleeps all but microseconds of each cycle.
STARVER = """
import os, signal, sys, time
pid = int(sys.argv[1])
try:
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
except OSError:
    pass
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
cycles = 0
try:
    while True:
        os.kill(pid, signal.SIGSTOP)
        time.sleep(0.1)
        os.kill(pid, signal.SIGCONT)
        cycles += 1
        time.sleep(0.01)
except ProcessLookupError:
    pass
finally:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
    print(f"{cycles} cycles at policy {os.sched_getscheduler(0)}", flush=True)
"""

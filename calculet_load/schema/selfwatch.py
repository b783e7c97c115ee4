"""When the client itself is the bottleneck: limits shared by the self-watch (which
samples) and the analysis (which excludes). Kept free of gevent so that `analysis`,
which never imports gevent (DESIGN §1), can read them."""

# A client whose loop lag passes this, or whose CPU passes SATURATED_CPU_PERCENT of one
# core, cannot stamp events on its loop or send on time to the millisecond: the
# analysis flags that window's requests. An open-loop request stamped by the kernel (its
# bytes' receive times, its send timed against its schedule) waits for no loop: the
# analysis judges it by its own bounds against this same limit instead of loop lag (its
# send lag, first token's late bound, start to sent: analysis.tables.saturation).
SATURATED_LAG_MS = 5.0
SATURATED_CPU_PERCENT = 90.0

# A closed-loop user's next request waits for the client to hand the last one back
# (ext.turnaround_ms). The analysis judges a closed-loop cell stamped by the kernel by
# that hold instead of loop lag: held when, on one worker, the mean hold per request
# passes SATURATED_LAG_MS and its share of the users' time passes this (the server had
# that much fewer streams than the cell's). Calibrated in docs/analysis.md: a client
# stopped 100 ms in every 110 holds 96 ms a request, 88 %; 256 streams of 680-ms
# requests, 12 ms and 1.7 %; the test suite's cells of 1-ms requests 0.7 ms and 56 %.
HELD_SHARE_LIMIT = 0.05

"""When the client itself is the bottleneck: limits shared by the self-watch (which
samples) and the analysis (which excludes). Kept free of gevent so that `analysis`,
which never imports gevent (DESIGN §1), can read them."""

# A client whose loop lag passes this, or whose CPU passes SATURATED_CPU_PERCENT of one
# core, cannot stamp events on its loop or send on time to the millisecond: the
# analysis flags that window's requests. An open-loop request stamped by the kernel (its
# bytes' receive times, its send timed against its schedule) waits for no loop: the
# analysis judges it by its own bounds against this same limit instead of loop lag (its
# send lag, first token's late bound, start to sent: analysis.tables.quality).
SATURATED_LAG_MS = 5.0
SATURATED_CPU_PERCENT = 90.0

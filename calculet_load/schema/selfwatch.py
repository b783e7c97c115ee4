"""When the client itself is the bottleneck: limits shared by the self-watch (which
samples) and the analysis (which excludes). Kept free of gevent so that `analysis`,
which never imports gevent (DESIGN §1), can read them."""

# A client whose loop lag passes this, or whose CPU passes SATURATED_CPU_PERCENT of one
# core, cannot stamp events to the millisecond: the analysis flags that window.
SATURATED_LAG_MS = 5.0
SATURATED_CPU_PERCENT = 90.0

// Holds the GPU for a given time, so that the launches queued behind it are timed back to back.
//
// Timing a batch of short kernels with events measures the host's launch rate (several us per
// launch from Python) when the GPU drains the queue faster than the host fills it. The backend
// launches this kernel first, then records the start event and queues the batch: while it spins,
// the whole batch is queued, and the events see only GPU time (nvbench's "blocking kernel", with
// a time limit instead of a host flag so that it can never hang).
extern "C" __global__ void spin_ns(unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}

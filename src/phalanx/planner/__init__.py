"""The scaling planner: predict a training step's timeline and the speed-up at N devices.

``cluster`` (nodes, devices, links), ``step`` (one device's step profile), ``schedules`` (each
strategy's messages per bucket), ``network`` (messages on links), ``sim`` (the step's
discrete-event simulation), ``trace`` (Chrome traces), ``plan`` (the sweep behind
``phalanx plan``), ``published`` (published setups to validate against). docs/planner.md.
"""

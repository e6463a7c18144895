"""What protects the cut, all of it at the data party: noise and clipping
(cut_dp), the trained bottleneck, calibration on public text, the private
warm-up, the emulator of B's blocks, and attaching them to a session
(attach).
"""

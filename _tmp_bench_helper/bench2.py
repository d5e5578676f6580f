import torch, time, resource, sys
from hf_hilbert_attn import DilatedPattern, dilated_attention
pat = DilatedPattern.from_yaml(sys.argv[1] if len(sys.argv)>1 else "configs/longnet_lm.yaml")
S=int(sys.argv[2]) if len(sys.argv)>2 else 32768
torch.manual_seed(0)
q=torch.randn(1,4,S,16); k=torch.randn(1,4,S,16); v=torch.randn(1,4,S,16)
for it in range(2):
    t=time.time(); c=time.process_time(); o=dilated_attention(q,k,v,pat,backend="torch"); print("fwd wall %.2f cpu %.2f"%(time.time()-t, time.process_time()-c), flush=True)
q.requires_grad_(); k.requires_grad_(); v.requires_grad_()
for it in range(2):
    t=time.time(); c=time.process_time(); o=dilated_attention(q,k,v,pat,backend="torch"); t1=time.time(); o.sum().backward(); print("fwd %.2f bwd %.2f cpu %.2f"%(t1-t, time.time()-t1, time.process_time()-c), q.grad.abs().sum().item(), flush=True)
print("maxrss MB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss/1024)

# TEMPORARY dev shim (not to be committed): stands in for PagePool and pack/unpack until merged.
import collections, torch
class PoolExhausted(RuntimeError): pass
class PagePool:
    def __init__(self, page_bytes, budget_bytes, device="cpu"):
        self.page_bytes=page_bytes; self.budget=budget_bytes; self.device=torch.device(device)
        self.pages=collections.OrderedDict(); self.pins={}; self.slots=[]; self.evicted=[]; self.peak=0
    def _inuse(self): return len(self.pages)*self.page_bytes
    def _evict_one(self):
        for k in self.pages:
            if self.pins.get(k,0)==0:
                self.pages.pop(k); self.evicted.append(k); return True
        return False
    def allocate_pinned(self, key):
        assert key not in self.pages
        while self._inuse()+self.page_bytes > self.budget:
            if not self._evict_one(): raise PoolExhausted("all pinned")
        t=torch.empty(self.page_bytes, dtype=torch.uint8, device=self.device)
        self.pages[key]=t; self.pins[key]=1; self.peak=max(self.peak,self._inuse()); return t
    def lookup_pin(self, keys):
        out=[]
        for k in keys:
            if k in self.pages:
                self.pages.move_to_end(k); self.pins[k]=self.pins.get(k,0)+1; self.slots.append(self.pages[k]); out.append(len(self.slots)-1)
            else: out.append(-1)
        return out
    def page(self, slot): return self.slots[slot]
    def unpin_many(self, keys):
        for k in keys: assert self.pins[k]>0; self.pins[k]-=1
    def is_pinned(self, k): return self.pins.get(k,0)>0
    def contains(self, k): return k in self.pages
    def free(self, k): assert self.pins.get(k,0)==0; self.pages.pop(k); self.pins.pop(k,None)
    def record_stream(self, k, s): pass
    def drain_evicted(self): e=self.evicted; self.evicted=[]; return e
    def set_budget(self, b):
        self.budget=b
        while self._inuse()>b and self._evict_one(): pass
    def stats(self): return {"peak_in_use_bytes": self.peak}
    def reset_peak(self): self.peak=self._inuse()
    @staticmethod
    def view(page, dtype, shape):
        n=1
        for s in shape: n*=s
        return page[: n*torch.empty((),dtype=dtype).element_size()].view(dtype).view(shape)
def _pc(self, k): return self.pins.get(k, 0) if k in self.pages else 0
PagePool.pin_count = _pc
